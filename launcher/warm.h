#ifndef RDMA_CNI_WARM_H
#define RDMA_CNI_WARM_H

enum warm_outcome {
    WARM_NO_SERVER,  /* nothing listens: worth starting a server */
    WARM_NOT_SERVED, /* a server exists but did not take this command: run it cold */
};

/* Nonzero unless RDMA_CNI_WARM is 0, off, false or no. */
int warm_enabled(void);

/* Run this invocation in the warm server of `tree`. Returns only when the
 * command was not run there (the caller then runs it cold); otherwise exits
 * with the command's exit status. */
enum warm_outcome warm_run(const char *tree);

/* Start a detached warm server from `program` (the cached executable) for
 * `launcher` (this executable, which the server watches for upgrades). */
void warm_spawn(const char *program, const char *launcher);

#endif

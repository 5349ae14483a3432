#ifndef RDMA_CNI_GUARD_H
#define RDMA_CNI_GUARD_H

/* The argument that starts the launcher as an IPAM guard (see guard.c). */
#define GUARD_ARG "--ipam-guard"

/* `launcher --ipam-guard <budget ms> <ipam program> [arguments]`: run the IPAM program
 * and report to fd 1. Returns the launcher's exit status. */
int guard_main(int argc, char **argv);

#endif

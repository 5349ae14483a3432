#ifndef RDMA_CNI_SHIM_H
#define RDMA_CNI_SHIM_H

#include <stdint.h>

/* Kept equal to rdma_cni.__version__ and rdma_cni.cni.protocol (a unit test checks). */
#define SHIM_VERSION "0.1.0"
#define SHIM_CNI_VERSION "1.1.0"
#define SHIM_SUPPORTED_VERSIONS "\"0.3.0\", \"0.3.1\", \"0.4.0\", \"1.0.0\", \"1.1.0\""

/* The wire format, read by rdma_cni/agent/cniserver.py (native byte order: one host). */
#define SHIM_REQUEST_MAGIC "RCNISHQ1"
#define SHIM_ANSWER_MAGIC "RCNISHA1"
#define SHIM_FLAG_NETNS 1u /* the pod's network namespace is attached (SCM_RIGHTS) */

struct shim_request {
    char magic[8];
    uint32_t env_len;    /* NUL-terminated KEY=VALUE entries */
    uint32_t stdin_len;  /* the network configuration as the runtime gave it */
    uint32_t flags;
    int32_t netns_errno; /* CNI_NETNS could not be opened here: why (0 otherwise) */
};

struct shim_answer {
    char magic[8];
    int32_t status; /* the plugin's exit status */
    uint32_t stdout_len;
    uint32_t stderr_len;
    uint32_t reserved;
};

#endif

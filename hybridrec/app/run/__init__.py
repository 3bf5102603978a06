"""Running a job on this machine (`hybridrec run`): what is checked before anything starts (preflight), the
launcher that starts, watches and restarts every service as a local process, the fork servers whose
pre-imported parents those processes are forked from, the progress line, free ports, the local NATS broker a
run on `data.stream` starts, and the compiled kernels a container image seeds its cache with."""

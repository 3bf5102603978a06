"""What a job needs and where it runs: the layout fitted to this host's cores and GPUs (layout), the job's plan
of every replica's address and part (job_plan, plan.json), the bytes a PS shard holds and its checkpoints
write (memory), and what `hybridrec plan` computes and prints from them (show)."""

"""What one process writes and another reads back: model bundles (`bundle`), live model versions (`versions`),
job checkpoints (`checkpoints`), the run summary (`summary`), files written whole and directories with one owner
(`files`), the event stream's messages (`event_stream`), an NN worker's shared-memory slots (`slot_layouts`),
and the Criteo sample format with its compiled line parser (`criteo_format`, `criteo_kernels`)."""

"""The NN worker's optional receiver (`training.receiver`): a child process that holds the rank's network face, so
the trainer's event loop spends no time on gRPC.

* process.py — the receiver process itself (`Receiver`): its gRPC server and its calls to the embedding workers;
  `python -m services.nn_worker.receiver REPLICA` starts it (__main__.py);
* receiver_link.py — the trainer's side (`ReceiverLink`): starts the receiver, hands it the step's lookups and
  pushes, serves the calls it forwards, replaces it when it dies;
* link.py — the transport between the two: shared-memory slots and the messages that name them.

A separate wing: the NN worker runs the same without it (`routing.EmbeddingWorkers` makes the calls in-process),
and no other module of the NN worker imports it but server.py, which starts the link when the config asks
for it.
"""

"""`python -m services.nn_worker.receiver REPLICA`: the receiver process (process.py), as `ReceiverLink` starts it
(a module path, not a file path: the process finds the code wherever the trainer's checkout is)."""
from services.nn_worker.receiver.process import main

main()

"""The NN worker's dense group: the ranks that train one dense model together, and how they stay one group.

* dense_group.py — `DenseGroup`: a rank's place in the group; runs collectives on the compute thread and
  re-forms the group around a lost peer's replacement;
* membership.py — `Membership`: joining a generation of the group (rendezvous, fingerprint, who hands over);
* handover.py — `hand_over`: the source rank's model, optimizer and counters, broadcast to every rank;
* distributed.py — process groups and the dense synchronisation of each mode (`DenseSync`, `DistEnv`);
* shadow.py — `ShadowSync`: shadow mode's background averaging of replicas.

Kept apart from the training pipeline (trainer.py) so that what survives a lost peer reads as one piece: the
trainer and the checkpointer hold a `DenseGroup` and call it; none of these modules imports the trainer.
"""

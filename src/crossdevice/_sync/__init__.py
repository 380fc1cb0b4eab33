"""Layer 2, the synchronisation kernel: the rendezvous, its rounds, waiting, call signatures.

No arrays and no torch here: the replica execution and the in-process communicators both
stand on it (docs/design.md §2b).
"""

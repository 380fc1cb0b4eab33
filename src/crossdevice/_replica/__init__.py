"""Layer 7: replica execution (threads, merge_call) and the replica context."""

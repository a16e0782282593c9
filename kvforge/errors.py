"""The library's own exception types.

Bad arguments to a public function raise the built-in ``ValueError`` / ``TypeError`` (naming the argument and
what was expected). Misuse of a stateful object (a cache closed twice, a commit past capacity) raises
``KvforgeError`` subclasses, so callers can tell a broken call sequence from a bad value.
"""


class KvforgeError(RuntimeError):
    """Base class for state-machine misuse detected by kvforge."""


class CacheStateError(KvforgeError):
    """An operation is not valid in a KV cache's current state; nothing was changed."""


class OutOfPagesError(KvforgeError):
    """No page could be found even after eviction."""


class TransferError(KvforgeError):
    """A KV transfer failed, timed out or was cancelled."""


class SchedulerDeadlockError(KvforgeError):
    """No request can make progress and nothing can be preempted."""

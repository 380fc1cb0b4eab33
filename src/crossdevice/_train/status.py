"""What a restore matched: TF's `CheckpointLoadStatus` and `InitializationOnlyStatus`.

A status compares two sets: the objects the checkpoint tracks, and the values the
checkpoint file holds. Objects assigned to the checkpoint after `restore` are matched
then (TF's restore-on-create), so the assertions look at the sets when they are called.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CheckpointLoadStatus", "InitializationOnlyStatus"]


class CheckpointLoadStatus:
    """What `Checkpoint.restore` or `read` matched; each assertion returns the status.

    Args:
        path: the checkpoint restored.
        tracked: names of the objects the checkpoint tracks now.
        saved: names of the values the checkpoint file holds.
        matched: names loaded so far (grows as objects are assigned later).
    """

    def __init__(
        self,
        path: str,
        tracked: Callable[[], set[str]],
        saved: set[str],
        matched: set[str],
    ) -> None:
        self._path = path
        self._tracked = tracked
        self._saved = saved
        self._matched = matched

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every tracked object got a value, and every saved value went to an object.

        Raises:
            AssertionError: naming the objects without a value and the unused values.
        """
        self.assert_existing_objects_matched()
        unused = sorted(self._saved - self._matched)
        if unused:
            raise AssertionError(
                f"the checkpoint {self._path!r} holds values nothing took: {unused!r}. Track "
                "objects under those names (ckpt.name = obj restores it now), or call "
                "expect_partial() / assert_existing_objects_matched() if that is intended"
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every object the checkpoint tracks got a value from the file.

        Raises:
            AssertionError: naming the objects the checkpoint file has no value for.
        """
        missing = sorted(self._tracked() - self._matched)
        if missing:
            raise AssertionError(
                f"the checkpoint {self._path!r} has no value for {missing!r} (it holds "
                f"{sorted(self._saved)!r}); was it written by another program?"
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """At least one tracked object got a value.

        Raises:
            AssertionError: nothing matched.
        """
        if not self._matched:
            raise AssertionError(
                f"nothing of the checkpoint {self._path!r} matched: it holds "
                f"{sorted(self._saved)!r} and the checkpoint tracks {sorted(self._tracked())!r}"
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Say that a partial match is intended (TF then stops warning about it)."""
        return self

    def __repr__(self) -> str:
        return f"CheckpointLoadStatus({self._path!r}, matched={sorted(self._matched)!r})"


_NOTHING = "No checkpoint specified (save_path=None); nothing is being restored."


class InitializationOnlyStatus:
    """What `restore(None)` returns: nothing was restored, so every assertion fails."""

    def assert_consumed(self) -> InitializationOnlyStatus:
        """Always raises AssertionError: nothing was restored."""
        raise AssertionError(_NOTHING)

    def assert_existing_objects_matched(self) -> InitializationOnlyStatus:
        """Always raises AssertionError: nothing was restored."""
        raise AssertionError(_NOTHING)

    def assert_nontrivial_match(self) -> InitializationOnlyStatus:
        """Always raises AssertionError: nothing was restored."""
        raise AssertionError(_NOTHING)

    def expect_partial(self) -> InitializationOnlyStatus:
        """Nothing to silence; returns the status."""
        return self

    def __repr__(self) -> str:
        return "InitializationOnlyStatus()"

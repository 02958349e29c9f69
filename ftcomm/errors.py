"""Every error ftcomm raises, each with a message that says what to do next."""

from __future__ import annotations


class FtcommError(Exception):
    """Base class of all ftcomm errors."""


class GossipError(FtcommError):
    """The membership layer could not do what was asked (bind, reach a member, authenticate)."""


class JoinError(GossipError):
    """No seed member answered within the join timeout."""


class MembershipChanged(FtcommError):
    """The view changed during a collective; the collective's result must not be used.

    Raised by the group's collectives inside :meth:`ftcomm.FaultTolerantGroup.execute`,
    which catches it, re-forms the group, reconciles state and retries.
    """


class CollectiveAborted(MembershipChanged):
    """A collective was abandoned because a member of its view was suspected, died or left."""


class CommunicatorError(MembershipChanged):
    """The backend failed a collective or could not form a communicator (a peer vanished)."""


class AddressError(FtcommError, ValueError):
    """The bind address cannot work with the peers given (loopback against other hosts, a wildcard)."""


class QuorumLost(FtcommError):
    """This worker cannot reach a majority of the previous view within ``quorum_timeout``."""


class ConfigMismatch(FtcommError):
    """Workers of one group were started with incompatible settings."""


class GroupEnded(FtcommError):
    """This worker joined a group whose members then all left gracefully (the job finished,
    or was scaled to zero) before it was admitted, or arrived to find only the final records
    of members that left the group after training: there is no group to join, and founding
    a new one would train from scratch beside the job's result. Exit; a job started again
    founds its group anew."""


class ReplicaLost(FtcommError):
    """A process of this worker's sharded replica died or left, and the replica cannot be
    formed again with a replacement in place (not started by ``ftcomm run``, NCCL, no other
    replica holds the state, or no replacement came): torch's process group inside the
    replica is broken, so this process cannot train again. Exit; the launcher
    (``ftcomm run --replica-size K``) starts the whole replica again, and it rejoins.
    ``shard``: the lost process's shard rank, where known; ``left``: it left gracefully (its
    script ended or shut the group down): nothing to repair; ``reason``: what was lost, in
    words, without the advice (the message when not given)."""

    def __init__(self, message: str, shard: int | None = None, left: bool = False,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.shard, self.left, self.reason = shard, left, reason or message


class StateLost(FtcommError):
    """Some shard of the group's newest state is held by no member of the view: every replica
    that held it is gone, and a replica that was receiving it got some of its shards only.
    The shards cannot be put together into one model. Exit; a job started again restores its
    newest checkpoint."""


class StateDiverged(FtcommError):
    """The training state's fingerprints differ between members (``fingerprint_every``):
    silent data corruption. Raised on a member named again soon after a repair (its hardware
    keeps computing wrong: it has left the group when this reaches the script, ``leaves``),
    on every member under ``sdc_policy='stop'``, and on every member when no fingerprint has
    a majority (nobody can tell which state is right: restart from a checkpoint of the last
    step where all agreed, which the message names). ``step`` is the step the fingerprints
    were of; ``named`` the members whose state differed (all of them without a majority;
    with sharded replicas, empty on the processes of the shard indices that agreed)."""

    def __init__(self, message: str, step: int = 0, named: tuple[str, ...] = (), leaves: bool = False) -> None:
        super().__init__(message)
        self.step, self.named, self.leaves = step, named, leaves


class RetryLimitExceeded(FtcommError):
    """``execute``, or ``wait_gradients_ready``, failed more than ``max_retries`` times in a
    row because the membership kept changing."""


class OutOfStep(FtcommError):
    """A collective outside a gradient step (``execute``, ``allreduce``, ...) was abandoned,
    not run or run again: the group re-formed while this worker was at it, and the members
    of the new view are not all at this same call (a joiner is at its first gradient step,
    another member already finished the call, or this worker was cut off and received the
    group's newer state). Running it would wait for members that never join it. Carry on
    with the training loop: the group meets again at the next gradient step."""


class NotInView(FtcommError):
    """The worker is in no view right now (a straggler standing aside, a worker rejoining, a
    group that was shut down): ``rank`` and ``world_size`` have no value."""


class FtcommTimeout(FtcommError, TimeoutError):
    """A bounded wait of ftcomm ran out (group formation, init)."""


class NcclUnavailable(FtcommError):
    """backend='nccl' cannot be used here: libnccl.so.2 missing or too old, or no CUDA device."""


class StateError(FtcommError, TypeError):
    """The registered state holds something that is not a tensor or plain data, or state
    bytes from a peer or a checkpoint are malformed (nothing is ever unpickled)."""


class SecretRequired(FtcommError, ValueError):
    """A group reachable from other hosts was started without a secret (protected mode)."""


class OtherModel(StateError):
    """A checkpoint holds other parameters (names, dtypes or shapes) than a registered
    module: saved from another model, or planted. ``FlashCheckpointer.restore()`` skips such
    a copy for an older step that fits, and raises this only when no copy fits: restore
    with the model the checkpoints were saved from."""

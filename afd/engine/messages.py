"""The front end ↔ replica plane: every message between the serving front end and one engine replica.

A replica is one engine behind a message pipe (afd/engine/serve_loop.py): the engine-core process of a
monolithic server, one attention rank of a disaggregated run, or an engine on a thread of the front
end's process. Requests go in as token ids with their sampling params; token ids come back, one
:class:`Deltas` per step. The front end works out the text (afd/serving/frontend.py).

Every message is a frozen dataclass and is dispatched with ``match``; a message nobody handles raises
:class:`UnhandledMessage`, naming it. To add one: define it here, handle it in the serve loop (a
command) or in the front end and the replica clients (an event), and say it in docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afd.config import SamplingParams
from afd.engine.request import TokenDelta


class UnhandledMessage(RuntimeError):
    """A message reached a receiver that has no case for it (a bug: every message has a handler)."""

    def __init__(self, receiver: str, message: object) -> None:
        super().__init__(f"{receiver}: no handler for {type(message).__name__} ({message!r:.200})")


# ----------------------------------------------------------------------------- front end -> replica


@dataclass(frozen=True, slots=True)
class NewRequest:
    """One request for the engine. ``output_ids``: a request moved from a lost replica (or waiting for a
    restart), with the tokens it already streamed: they are recomputed with the prompt, not sent again."""

    rid: int  # the front end's request id; every delta of it carries this as its tag
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    output_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class AddRequests:
    """The requests the front end took in one turn of its event loop: they reach the engine before its next step."""

    requests: tuple[NewRequest, ...]


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """The client went away (or a stop string ended the request): free its KV blocks wherever it is."""

    rid: int


@dataclass(frozen=True, slots=True)
class StartWave:
    """Every attention rank joins wave ``wave`` of agreed steps (afd/attention/steps.py)."""

    wave: int


@dataclass(frozen=True, slots=True)
class StopServing:
    """Abort everything, reply :class:`Stopped`, and leave the serving loop."""


# ----------------------------------------------------------------------------- replica -> front end


@dataclass(frozen=True, slots=True)
class Deltas:
    """What one step produced: a :class:`TokenDelta` per request that sampled (its tag is the rid)."""

    deltas: tuple[TokenDelta, ...]
    stats: dict[str, object]


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request could not be admitted (e.g. it can never fit the KV cache)."""

    rid: int
    message: str


@dataclass(frozen=True, slots=True)
class NeedWave:
    """Work (or a restart to take in) arrived while the attention ranks wait: start wave ``wave`` on every one."""

    wave: int


@dataclass(frozen=True, slots=True)
class StatsReport:
    """The replica's counters, when they changed while it was idle."""

    stats: dict[str, object]


@dataclass(frozen=True, slots=True)
class Stopped:
    """The answer to :class:`StopServing`: the replica left its serving loop, with its last counters."""

    stats: dict[str, object] = field(default_factory=dict)


# ----------------------------------------------------------------------------- a replica client -> front end


@dataclass(frozen=True, slots=True)
class ReplicaLost:
    """A replica (an attention rank) is gone: its requests move to the others, or wait for its restart."""

    cause: str


@dataclass(frozen=True, slots=True)
class ReplicaRestarted:
    """A lost replica is back (``incarnation``): the requests that waited for it resume there."""

    incarnation: int


#: what a replica client's ``poll`` yields, as (replica, event)
ReplicaEvent = Deltas | Rejected | StatsReport | Stopped | ReplicaLost | ReplicaRestarted

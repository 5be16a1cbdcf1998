"""The launcher ↔ rank plane: every control message between a run's processes and the process that runs them.

Each rank (and a monolithic server's engine core) has one pipe to its launcher. It carries these
messages, and while an attention rank serves, the front end ↔ replica messages of
afd/engine/messages.py too. Every message is a frozen dataclass, dispatched with ``match``; one nobody
handles raises :class:`~afd.engine.messages.UnhandledMessage`. To add one: define it here, send it, add
its case where it is received (afd/runtime/cluster.py on the launcher's side; attention_rank.py or
ffn_rank.py on a rank's), and list it in docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from afd.config import CostModel, PipelineConfig
from afd.distributed.placement import ExpertPlacement

# ----------------------------------------------------------------------------- any process -> its launcher


@dataclass(frozen=True, slots=True)
class ReadyReport:
    """A rank loaded its weights and opened its links: the tensors it holds and the bytes it read."""

    rank: str
    pid: int
    tensors: tuple[str, ...]
    bytes_read: int


@dataclass(frozen=True, slots=True)
class Ready:
    report: ReadyReport


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The engine core of a monolithic server is serving."""

    pid: int
    max_model_len: int
    limits: str  # EngineLimits.describe(): what the flags came to


@dataclass(frozen=True, slots=True)
class Failed:
    """The process fails: one line naming it and its pid, and the traceback."""

    text: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Loaded:
    """A replacement FFN rank (or a restarted attention rank) has its weights and its readers open: the
    peers may link to it now."""


@dataclass(frozen=True, slots=True)
class Bye:
    """The last word of a rank leaving as asked, with its exit counters (FFN: items, batches, spans, ...)."""

    stats: Any = None


# ----------------------------------------------------------------------------- attention rank -> launcher


@dataclass(frozen=True, slots=True)
class FfnLost:
    """This attention rank stopped using an FFN rank (dead, or silent past the hang timeout)."""

    rank: int
    generation: int
    reason: str
    hung: bool


@dataclass(frozen=True, slots=True)
class FfnJoined:
    """This attention rank linked to FFN rank ``rank``'s replacement (``generation``)."""

    rank: int
    generation: int


@dataclass(frozen=True, slots=True)
class FfnJoinFailed:
    rank: int
    generation: int
    reason: str


@dataclass(frozen=True, slots=True)
class PlacementInUse:
    """This attention rank dispatches under expert placement ``version`` from this step on."""

    version: int


@dataclass(frozen=True, slots=True)
class Joining:
    """A restarted attention rank is built and asks the others to take it into their steps."""

    incarnation: int


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the oldest :class:`Request` this rank has not answered yet."""

    value: Any = None


# ----------------------------------------------------------------------------- FFN rank -> launcher


@dataclass(frozen=True, slots=True)
class FfnStats:
    """Live counters, at most once a second while the rank works (a server's /metrics)."""

    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlacementReady:
    """This FFN rank holds its copies of expert placement ``version`` (a rebalance)."""

    version: int


@dataclass(frozen=True, slots=True)
class AttentionSilent:
    """This FFN rank found attention rank ``rank`` hung (silent past the hang timeout)."""

    rank: int
    reason: str


# ----------------------------------------------------------------------------- launcher -> ranks


@dataclass(frozen=True, slots=True)
class Serve:
    """An attention rank: serve requests (afd/engine/serve_loop.py) until ``StopServing``. ``capture``: record
    every step's boundaries to this file."""

    pipeline: PipelineConfig | None = None
    capture: str | None = None


@dataclass(frozen=True, slots=True)
class FfnJoin:
    """An attention rank: link to FFN rank ``rank``'s replacement (``generation``), without waiting for it."""

    rank: int
    generation: int


@dataclass(frozen=True, slots=True)
class InstallPlacement:
    """An FFN rank: load its copies of ``placement`` beside the ones it serves. An attention rank: every
    FFN rank holds them; use them from the first step every vote has them."""

    version: int
    placement: ExpertPlacement


@dataclass(frozen=True, slots=True)
class Admit:
    """An attention rank: vote attention rank ``rank``'s restart (``incarnation``) into the agreed steps."""

    rank: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class AttentionJoin:
    """An FFN rank: open the links of attention rank ``rank``'s restart (``incarnation``)."""

    rank: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class AttentionGone:
    """An FFN rank: attention rank ``rank`` is not restarted; stop waiting for its SHUTDOWN."""

    rank: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave: SHUTDOWN on every link, reply :class:`Bye`, exit."""


# ----------------------------------------------------------------------------- requests (an attention rank answers with Reply)


@dataclass(frozen=True, slots=True)
class Request:
    """A command an attention rank answers with one :class:`Reply` (outside its serving loop)."""


@dataclass(frozen=True, slots=True)
class SetPipeline(Request):
    """Step with this pipeline from now on. Reply: None."""

    pipeline: PipelineConfig


@dataclass(frozen=True, slots=True)
class SetTrace(Request):
    """Record (True, from empty) or stop recording the runtime trace. Reply: None."""

    on: bool


@dataclass(frozen=True, slots=True)
class GetTrace(Request):
    """Reply: (the trace's events, the last micro-batch plan)."""


@dataclass(frozen=True, slots=True)
class Capture(Request):
    """One prefill batch of token-id prompts with every boundary captured (parity checks). Alone (a solo
    step), or ``together``: every attention rank got one, and they run as one agreed step aggregated on the
    FFN ranks. Reply: (values, logits), or None for a rank with no prompts."""

    prompts: tuple[tuple[int, ...], ...]
    together: bool = False


@dataclass(frozen=True, slots=True)
class GetRunnerStats(Request):
    """Reply: :class:`RunnerStats`."""


@dataclass(frozen=True, slots=True)
class RunnerStats:
    steps: int
    idle_steps: int
    degraded_steps: int
    votes: int
    learned_costs: CostModel | None = None  # the auto planner's model learned on this rank (None: not yet, or not learning)
    ffn_busy_s: float = 0.0  # the FFN side's compute of the unions this rank learned from (RESULT headers' busy_us)


@dataclass(frozen=True, slots=True)
class GetLinkStats(Request):
    """Reply: the mailbox's LinkStats."""


@dataclass(frozen=True, slots=True)
class Sleep(Request):
    """Tests: keep this rank's links idle for ``seconds``. Reply: None."""

    seconds: float

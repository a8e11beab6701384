"""Benchmark scenarios: a pool of simulated engines, a workload, phases and a timeline of actions.

Pure data plus the arithmetic that sizes the load; running them is ``bench.runner``'s job.

**Load level.** A scenario states its load as a share ``util`` of the pool's *saturation
throughput*: the request rate the engines sustain with every decode slot busy. Under the
simulator's physics (``services/sim_engine/physics.py``) a step of a batch of b on a chip with
decode speed d and hardware scale ref lasts ``T0/d · (1 + g·(b-1)/ref)`` (T0 = 32 ms, g = 4) and
each request also stalls its batch for its prefill ``P / (4000·p)``; so with mean output L and mean
prompt P, one engine of capacity c saturates at

    R_sat = speed / (L · step(c) / c + P / (4000 · p))      requests/s.

TPOT grows with the batch, so throughput is concave in the batch: a 910B reaches ~80 % of R_sat at
a batch of ~3 of its 10 slots. "60-75 % of capacity" in *slots* would mean ~95 % of throughput
(no headroom at all); the scenarios use 45-60 % of *throughput* (a batch of ~1.5-2 per 910B).

The announced drop runs at 60 %: a 10→1 drop of one node out of four then pushes the other three
to 80 % when the dropped node's traffic moves off it (real pressure, still stable), while a
capacity-blind policy keeps sending the node a quarter of the load, 125 % of what its one slot
sustains, so its queue grows for the whole drop. At 50 % that quarter is 104 % of the one slot:
a borderline case in which the queue grows too slowly within a phase to tell policies apart
(docs/evidence/code-choices.md).

The same concavity means a slot is worth more than its share: one slot of a 910B sustains 48 % of
its 10-slot throughput (at speed 4: 1.05 vs 2.19 requests/s with the default workload), so a 10→1
*slot* cut removes about half of the node's throughput, while the scheduler, for which capacity is
a throughput unit (docs/ascend.md §3: 10 × decode speed), moves ~97 % of its traffic away. Likewise
the chips' saturation throughputs (910C 8.0, 910B 2.19, 910 1.23 requests/s at speed 4) are not
in the ratio of their capacities 20 : 10 : 7. ``saturation_rps`` computes these figures.

**Trace scenarios** (``trace``: a ``bench.trace.TraceWindow``) replay a real trace instead of the
generated workload: its arrivals (``speed`` times faster) and token counts, and for Mooncake its
shared prefixes; ``util`` does not apply, the trace and its speed set the load. ``trace-mooncake``
gives every engine a 2 M-token KV room (``kv_tokens``: an 8B model with host-memory KV offload,
as Mooncake deploys it): with the chips' own rooms (0.3-0.7 M tokens, most of it reserved by
the running 12 k-token prompts) no router keeps a conversation's blocks between its turns, and
an ideal single LRU cache of the whole pool's room reaches 4 % on the first 300 s (every row
shares one leading block), against 21 % with unbounded room.

Phases around a disturbance have equal lengths so they hold about as many requests: with the
stratified lengths (``bench.workload``) each phase then sees the same length distribution, and
their P99s are comparable.

**Actions** (times in seconds from the start of the load, before ``--duration-scale``):
``capacity`` sets the engine's slots (engine admin) and, when ``announce``, publishes
``lb.admin.capacity.<node>`` at the same moment; ``slowdown`` and ``fail`` go to the engine admin
only (silent faults); ``fault_code`` makes the engine's simulated npu-exporter report a MindCluster
fault code (its own /health unchanged; a separating code leaves the node no capacity); ``health`` sets the Health its simulated ``npu-smi info`` shows (OK |
Warning | Alarm | Critical), which reaches the scheduler only through the collector's npu-smi
samples, as on real hardware; ``drain`` publishes ``lb.admin.drain.<node>`` only (the engine is
untouched: a router that reads no drain keeps using it); ``restart`` (real engines only) stops the
node's engine and starts it again on the same port, its caches empty; ``cache_reset`` (real vLLM
engines only) empties the node's prefix cache and nothing else (``POST /reset_prefix_cache``, the
requests it runs computed again): a restart's effect on the cache without its downtime, as on a
host where an engine restarts within seconds. Each action also defines the node's *true* capacity for the balance
metrics: 0 while its engine refuses (``fail: refuse``) or its NPU is ``Critical`` (docs/ascend.md §1:
eject now), whichever of the two or both; its slots again once neither holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from laswrr.bench.conversations import ChatSpec
from laswrr.bench.metrics import CapacityAt, Phase, capacity_timeline
from laswrr.bench.trace import TraceWindow
from laswrr.bench.workload import Tenant, WorkloadSpec, mean_output_tokens
from laswrr.schemas.words import Band, NodeRole, NpuHealth
from laswrr.services.sim_engine.config import HEALTH_STATES
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile

ActionKind = Literal["capacity", "slowdown", "fail", "health", "fault_code", "drain", "restart", "cache_reset"]
ACTION_KINDS: tuple[str, ...] = get_args(ActionKind)
DOWN_HEALTH = frozenset({NpuHealth.CRITICAL})  # an NPU health that leaves the node no capacity at all


@dataclass(frozen=True, slots=True)
class EngineSpec:
    node: str
    chip: str
    capacity: int  # engine decode slots, and the capacity registered with the scheduler
    flavour: str = "vllm"  # mindie: MindIE-flavoured sim engine, read through its /v1/status and npu-exporter
    role: NodeRole = NodeRole.BOTH  # prefill | decode: a prefill/decode pool's node (the scenario's ``pd_protocol``)

    @property
    def sim(self) -> tuple[str, str, int] | tuple[str, str, int, str]:
        """The ``Stack.start_sim_engines`` tuple of this engine."""
        base = (self.node, self.chip, self.capacity)
        return base if self.flavour == "vllm" else (*base, self.flavour)


@dataclass(frozen=True, slots=True)
class Action:
    at_s: float
    kind: ActionKind
    node: str
    value: Any  # capacity: int; slowdown: float; fail: "refuse" | "none" | ...; health: "OK" | "Critical" | ...
    announce: bool = False  # capacity only: also publish lb.admin.capacity.<node>
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"action kind must be one of {', '.join(ACTION_KINDS)}, got {self.kind!r}")
        if self.kind == "health" and self.value not in HEALTH_STATES:
            raise ValueError(f"health action value must be one of {', '.join(HEALTH_STATES)}, got {self.value!r}")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    engines: tuple[EngineSpec, ...]
    phases: tuple[Phase, ...]
    actions: tuple[Action, ...]
    util: float  # mean offered load, as a share of the pool's saturation throughput
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    speed: float = 4.0  # sim-engine --speed: every engine time divided by this
    scheduler_config: Mapping[str, Any] | None = None  # extra scheduler keys (a TOML file)
    focus_phase: str = ""  # the phase the goals look at (the disturbance)
    trace: TraceWindow | None = None  # replay this trace instead of generating ``workload``
    kv_tokens: int | None = None  # every engine's KV room (sim-engine --kv-tokens; real vLLM: blocks of 128); None: the chip's
    tenants: tuple[Tenant, ...] = ()  # API keys sending the load (bench.workload.assign_tenants); (): no key
    rate_rps: float | None = None  # the offered load itself, instead of ``util`` of the simulator's saturation
    # policy variants (bench.stack_adapter.VARIANTS) the default policy list runs too, each placed
    # before the default row of its policy or after it (``+flow`` before ``la-swrr``, ``+cap`` after)
    rows_before: tuple[str, ...] = ()
    rows_after: tuple[str, ...] = ()
    # a prefill/decode pool: the protocol its engines speak (None: whole requests); a peer router's
    # row runs its own (vllm-router: vllm, sglang-router: sglang: bench.stack_adapter.pd_protocol_for)
    pd_protocol: str | None = None
    chat: ChatSpec | None = None  # a chat workload (bench.conversations) instead of ``workload``
    proxies: int = 1  # proxy replicas (real engines: the load enters by each request's ``entry``)
    proxy_args: tuple[str, ...] = ()  # flags of every laswrr proxy of its rows
    kv_events: bool = False  # real engines: publish their KV cache events (vLLM --kv-events-config)
    rows: tuple[str, ...] = ()  # its own rows instead of the default policy list (--policies still names them)

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s

    @property
    def nodes(self) -> list[str]:
        return [e.node for e in self.engines]

    def scaled(self, factor: float) -> "Scenario":
        """Every time (phases, actions, workload duration) multiplied by ``factor``."""
        if factor <= 0:
            raise ValueError(f"duration scale must be > 0, got {factor}")
        phases = tuple(Phase(p.name, p.start_s * factor, p.end_s * factor) for p in self.phases)
        actions = tuple(replace(a, at_s=a.at_s * factor) for a in self.actions)
        trace = None if self.trace is None else self.trace.scaled(factor)
        return replace(self, phases=phases, actions=actions, trace=trace)

    def with_trace(self, trace: TraceWindow, replay_s: float) -> "Scenario":
        """This scenario replaying ``trace``, one phase ``trace`` as long as the replay."""
        return replace(self, trace=trace, phases=(Phase("trace", 0.0, replay_s),), focus_phase="trace")

    def workload_spec(self) -> WorkloadSpec:
        """The workload at ``util`` of the pool's saturation rate, over the whole scenario."""
        rate = self.rate_rps if self.rate_rps is not None else \
            self.util * pool_saturation_rps(self.engines, self.workload, self.speed)
        return replace(self.workload, duration_s=self.duration_s, rate_rps=round(rate, 3))

    def capacity_at(self) -> CapacityAt:
        return capacity_timeline({e.node: e.capacity for e in self.engines}, true_capacity_changes(self))


def saturation_rps(engine: EngineSpec, workload: WorkloadSpec, speed: float) -> float:
    """Requests/s one engine sustains with all its slots busy (module docstring)."""
    profile = get_profile(engine.chip)
    sim = EngineSim(profile, engine.capacity)
    mean_prompt = workload.prompt_median * _lognormal_mean_factor(workload.prompt_sigma)
    per_request = (mean_output_tokens(workload) * sim.decode_step_s(engine.capacity) / engine.capacity
                   + sim.prefill_s(round(mean_prompt)))
    return speed / per_request


def pool_saturation_rps(engines: Sequence[EngineSpec], workload: WorkloadSpec, speed: float) -> float:
    return sum(saturation_rps(e, workload, speed) for e in engines)


def _lognormal_mean_factor(sigma: float) -> float:
    return math.exp(sigma**2 / 2)


def true_capacity_changes(scenario: Scenario) -> list[tuple[float, str, float]]:
    """(t, node, capacity) steps of the engines' real capacity, for the balance metrics: its slots,
    or 0 while its engine refuses or its NPU is Critical (one step to 0 when both happen)."""
    slots = {e.node: float(e.capacity) for e in scenario.engines}
    current = dict(slots)
    refused: set[str] = set()
    critical: set[str] = set()
    changes: list[tuple[float, str, float]] = []
    for action in sorted(scenario.actions, key=lambda a: a.at_s):
        node = action.node
        if action.kind == "capacity":
            slots[node] = float(action.value)
        elif action.kind == "fail":
            (refused.add if action.value == "refuse" else refused.discard)(node)
        elif action.kind == "health":
            (critical.add if action.value in DOWN_HEALTH else critical.discard)(node)
        elif action.kind == "fault_code":  # a separating code (the scenarios use SeparateNPU): the chip is out
            (critical.add if action.value else critical.discard)(node)
        else:
            continue
        capacity = 0.0 if node in refused or node in critical else slots[node]
        if capacity != current[node]:
            current[node] = capacity
            changes.append((action.at_s, node, capacity))
    return changes


# --------------------------------------------------------------------------- the catalogue

HOMOGENEOUS = tuple(EngineSpec(f"n{i}", "910B", 10) for i in range(1, 5))
MIXED = (EngineSpec("c1", "910C", 20), EngineSpec("b1", "910B", 10), EngineSpec("b2", "910B", 10),
         EngineSpec("a1", "910", 7))


def _three_phases(names: tuple[str, str, str], t1: float, t2: float, end: float) -> tuple[Phase, ...]:
    return (Phase(names[0], 0.0, t1), Phase(names[1], t1, t2), Phase(names[2], t2, end))


ANNOUNCED_DROP = Scenario(
    name="announced-drop",
    description="4×910B (10 slots); n3 drops 10→1 (engine + lb.admin.capacity together), back to 10 later",
    engines=HOMOGENEOUS,
    phases=_three_phases(("steady", "drop", "recovery"), 14.0, 28.0, 42.0),
    actions=(Action(14.0, "capacity", "n3", 1, announce=True, label="n3 capacity 10→1"),
             Action(28.0, "capacity", "n3", 10, announce=True, label="n3 capacity 1→10")),
    util=0.6,
    focus_phase="drop",
)

SILENT_SLOWDOWN = Scenario(
    name="silent-slowdown",
    description="4×910B; n2's engine silently loses 8 of 10 slots and runs 2× slower (no announcement)",
    engines=HOMOGENEOUS,
    phases=_three_phases(("steady", "slow", "recovery"), 14.0, 28.0, 42.0),
    actions=(Action(14.0, "capacity", "n2", 2, label="n2 silently 10→2 slots, 2× slower"),
             Action(14.0, "slowdown", "n2", 2.0, label=""),
             Action(28.0, "capacity", "n2", 10, label="n2 back to 10 slots"),
             Action(28.0, "slowdown", "n2", 1.0, label="")),
    util=0.5,
    focus_phase="slow",
)

SILENT_SLOWDOWN_MINDIE = replace(
    SILENT_SLOWDOWN,
    name="silent-slowdown-mindie",
    description="4×910B MindIE (status on /v1/status, chips through npu-exporter); n2 silently loses 8 of 10 slots "
                "and runs 2× slower (no announcement)",
    engines=tuple(replace(e, flavour="mindie") for e in HOMOGENEOUS),
)

NPU_FAULT_MINDIE = Scenario(
    name="npu-fault-mindie",
    description="4×910B MindIE, chips through npu-exporter (5 s refresh); n4's chip reports SeparateNPU fault "
                "80E18402 (the engine still answers), cleared later",
    engines=tuple(replace(e, flavour="mindie") for e in HOMOGENEOUS),
    phases=_three_phases(("steady", "fault", "cleared"), 14.0, 28.0, 42.0),
    actions=(Action(14.0, "fault_code", "n4", "80E18402", label="n4 chip fault 80E18402 SeparateNPU"),
             Action(28.0, "fault_code", "n4", "", label="n4 fault cleared")),
    util=0.5,
    focus_phase="fault",
)

HETEROGENEOUS = Scenario(
    name="heterogeneous",
    description="910C (20) + 2×910B (10) + 910 (7) at steady load",
    engines=MIXED,
    phases=(Phase("warm", 0.0, 8.0), Phase("steady", 8.0, 36.0)),
    actions=(),
    util=0.6,
    focus_phase="steady",
)

CRASH_RETURN = Scenario(
    name="crash-return",
    description="4×910B; n4's NPU goes Critical in npu-smi and its engine refuses every connection (crash); "
                "later npu-smi shows OK again and the engine serves",
    engines=HOMOGENEOUS,
    phases=_three_phases(("steady", "crash", "return"), 14.0, 28.0, 42.0),
    actions=(Action(14.0, "health", "n4", NpuHealth.CRITICAL, label="n4 NPU Critical"),
             Action(14.0, "fail", "n4", "refuse", label="n4 crashes (refuse)"),
             Action(28.0, "health", "n4", NpuHealth.OK, label="n4 NPU OK"),
             Action(28.0, "fail", "n4", "none", label="n4 returns")),
    util=0.5,
    focus_phase="crash",
)

BURSTY = Scenario(
    name="bursty",
    description="910C + 2×910B + 910 under on/off bursts (3 s at 2.5× the mean rate every 9 s)",
    engines=MIXED,
    phases=(Phase("warm", 0.0, 9.0), Phase("bursts", 9.0, 45.0)),
    actions=(),
    util=0.45,
    workload=WorkloadSpec(arrival="bursty", burst_on_s=3.0, burst_off_s=6.0, burst_factor=2.5),
    focus_phase="bursts",
)

SMOKE = Scenario(
    name="smoke",
    description="tiny: 2×910B, one capacity drop, a few seconds (tests)",
    engines=(EngineSpec("n1", "910B", 4), EngineSpec("n2", "910B", 4)),
    phases=_three_phases(("steady", "drop", "recovery"), 1.0, 2.0, 3.0),
    actions=(Action(1.0, "capacity", "n2", 1, announce=True, label="n2 4→1"),
             Action(2.0, "capacity", "n2", 4, announce=True, label="n2 1→4")),
    util=0.4,
    workload=WorkloadSpec(output_median=24.0, output_max=64, prompt_median=100.0, prompt_max=512,
                          cancel_share=0.1, cancel_min_s=0.05, cancel_max_s=0.3),
    speed=10.0,
    focus_phase="drop",
)

OVERLOAD = Scenario(
    name="overload",
    description="4×910B at 2× their saturation throughput for 60 s from 4 API keys offering 10:1:1:1: a batch "
                "job (batch) and three users (interactive, default, a mix of the two)",
    engines=HOMOGENEOUS,
    phases=(Phase("overload", 0.0, 60.0),),
    actions=(),
    util=2.0,
    workload=WorkloadSpec(cancel_share=0.0),
    focus_phase="overload",
    tenants=(Tenant("batch-job", 10.0, Band.BATCH), Tenant("user-interactive", 1.0, Band.INTERACTIVE),
             Tenant("user-default", 1.0, Band.DEFAULT), Tenant("user-mix", 1.0, "mix")),
    rows_before=("la-swrr+flow",),  # one run for every row: flow control, today's default, today's cap, the peers
    rows_after=("la-swrr+cap",),
)

OVERLOAD_SMALL = replace(
    OVERLOAD, name="overload-small",
    description="overload on small nodes: 4×910B of 8 slots at 2× their saturation throughput for 60 s, the same "
                "4 API keys (a limit under 10: the interactive reserve must still keep a slot)",
    engines=tuple(EngineSpec(f"n{i}", "910B", 8) for i in range(1, 5)),
)

TRACE_POOL = (EngineSpec("c1", "910C", 20), EngineSpec("b1", "910B", 10), EngineSpec("b2", "910B", 10),
              EngineSpec("b3", "910B", 10))

TRACE_MOONCAKE = Scenario(
    name="trace-mooncake",
    description="Mooncake FAST'25 conversation trace, first 300 s at 2× (shared prefixes); 910C + 3×910B, "
                "2 M-token KV rooms",
    engines=TRACE_POOL,
    phases=(Phase("trace", 0.0, 150.0),),
    actions=(),
    util=0.0,
    speed=16.0,
    focus_phase="trace",
    trace=TraceWindow("mooncake_conversation_first300s.jsonl", 0.0, 300.0, 2.0),
    kv_tokens=2_000_000,
)

TRACE_AZURE_CODE = Scenario(
    name="trace-azure-code",
    description="Azure 2023 code trace, first 300 s at 2× (bursty, unshared prompts); 910C + 2×910B + 910",
    engines=MIXED,
    phases=(Phase("trace", 0.0, 150.0),),
    actions=(),
    util=0.0,
    speed=6.0,
    focus_phase="trace",
    trace=TraceWindow("azure2023_code_first300s.csv", 0.0, 300.0, 2.0),
)

SMOKE_TRACE = Scenario(
    name="smoke-trace",
    description="tiny: 2×910B, 10 s of the Mooncake slice at 10× (tests)",
    engines=(EngineSpec("n1", "910B", 4), EngineSpec("n2", "910B", 4)),
    phases=(Phase("trace", 0.0, 1.0),),
    actions=(),
    util=0.0,
    speed=40.0,
    focus_phase="trace",
    trace=TraceWindow("mooncake_conversation_first300s.jsonl", 0.0, 10.0, 10.0),
    kv_tokens=2_000_000,
)

PD = Scenario(
    name="pd",
    description="a prefill/decode pool: 2 prefill + 2 decode 910B, prefill p2 at half speed throughout, decode d2 "
                "drained mid-run (lb.admin.drain: laswrr drains it; a peer router cannot be told)",
    engines=(EngineSpec("p1", "910B", 10, role=NodeRole.PREFILL), EngineSpec("p2", "910B", 10, role=NodeRole.PREFILL),
             EngineSpec("d1", "910B", 10, role=NodeRole.DECODE), EngineSpec("d2", "910B", 10, role=NodeRole.DECODE)),
    phases=_three_phases(("steady", "drain", "after"), 12.0, 24.0, 36.0),
    actions=(Action(0.0, "slowdown", "p2", 2.0, label="p2 at half speed"),
             Action(12.0, "drain", "d2", None, label="d2 drained")),
    util=0.0,
    rate_rps=1.6,  # a decode-only 910B sustains ~2.4 requests/s of this workload at speed 4: d1 alone at ~68 %
    workload=WorkloadSpec(prompt_median=2000.0, prompt_max=8192),
    focus_phase="drain",
    pd_protocol="vllm",
)

PD_SGLANG = replace(PD, name="pd-sglang", pd_protocol="sglang",
                    description=PD.description + "; laswrr's rows on sglang engines (both legs at once)")
PD_LONG_PROMPTS = replace(PD, name="pd-long-prompts", rate_rps=1.4,
                          workload=WorkloadSpec(prompt_median=8000.0, prompt_max=16384),
                          description=PD.description + "; prompts of median 8,000 tokens: the half-speed prefill "
                                                       "node cannot take half of them")

PD_PREFILL_DRAIN = replace(PD_LONG_PROMPTS, name="pd-prefill-drain",
                           description="a prefill/decode pool: 2 prefill + 2 decode 910B, prefill p2 at half speed "
                                       "throughout and drained mid-run (lb.admin.drain: laswrr drains it; a peer "
                                       "router cannot be told); prompts of median 8,000 tokens, so that the drain "
                                       "finds prefill legs on p2",
                           actions=(Action(0.0, "slowdown", "p2", 2.0, label="p2 at half speed"),
                                    Action(12.0, "drain", "p2", None, label="p2 drained")))

SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (ANNOUNCED_DROP, SILENT_SLOWDOWN, SILENT_SLOWDOWN_MINDIE, NPU_FAULT_MINDIE,
                        HETEROGENEOUS, CRASH_RETURN, BURSTY, OVERLOAD, OVERLOAD_SMALL, TRACE_MOONCAKE,
                        TRACE_AZURE_CODE, PD, PD_SGLANG, PD_LONG_PROMPTS, PD_PREFILL_DRAIN, SMOKE, SMOKE_TRACE)
}
TEST_SCENARIOS = frozenset({SMOKE.name, SMOKE_TRACE.name})  # tiny, for tests: not in ``--scenario all``


# --------------------------------------------------------------------------- real vLLM engines
#
# `laswrr bench --engines vllm`: three real vLLM servers (CPU build, the tiny model of
# bench/tiny_model.py; bench/real_vllm.py) with --max-num-seqs 8, 4 and 2, registered with those
# capacities. The load is stated as a rate (the simulator's saturation arithmetic does not apply),
# light enough that the policies' ordering holds across repeats on this 2-core machine. A real
# engine cannot change its --max-num-seqs while it runs, so the announced drop is the announcement
# alone (lb.admin.capacity: an operator reserving 6 of vllm-8's slots for something else): the
# engine keeps its slots, laswrr moves the traffic, the peers cannot know.

REAL_ENGINES = (EngineSpec("vllm-8", "cpu", 8), EngineSpec("vllm-4", "cpu", 4), EngineSpec("vllm-2", "cpu", 2))
REAL_WORKLOAD = WorkloadSpec(prompt_median=120.0, prompt_sigma=0.6, prompt_max=600, output_median=48.0,
                             output_sigma=0.5, output_max=160, cancel_share=0.0)

REAL_HETEROGENEOUS = Scenario(
    name="heterogeneous",
    description="3 real vLLM (CPU, tiny model): --max-num-seqs 8, 4, 2 at steady load",
    engines=REAL_ENGINES,
    phases=(Phase("warm", 0.0, 8.0), Phase("steady", 8.0, 48.0)),
    actions=(),
    util=0.0,
    rate_rps=1.6,
    workload=REAL_WORKLOAD,
    speed=1.0,
    focus_phase="steady",
)

REAL_ANNOUNCED_DROP = Scenario(
    name="announced-drop",
    description="3 real vLLM (CPU, tiny model): 8, 4, 2 slots; vllm-8 announced 8→2 (lb.admin.capacity), back later",
    engines=REAL_ENGINES,
    phases=_three_phases(("steady", "drop", "recovery"), 16.0, 32.0, 48.0),
    actions=(Action(16.0, "capacity", "vllm-8", 2, announce=True, label="vllm-8 announced 8→2"),
             Action(32.0, "capacity", "vllm-8", 8, announce=True, label="vllm-8 announced 2→8")),
    util=0.0,
    rate_rps=1.6,
    workload=REAL_WORKLOAD,
    speed=1.0,
    focus_phase="drop",
)

# The exact cache view's effect: chat requests (the chat template matters: the proxy renders it to
# compute the engine's tokens) over shared system prompts and multi-turn conversations, on KV rooms
# of REAL_CACHE_BLOCKS blocks of 128 tokens (--num-gpu-blocks-override) so the engines evict, and
# two events only the engines' own KV events show: vllm-8 restarted (its cache empty afterwards,
# while each proxy's estimate still credits it with what it was sent) and 30 % of the requests
# entering through a second proxy that shares nothing with the first (the channel between proxies
# off: neither proxy's estimate holds what the other sent). ``cache-plain``: the same workload
# through one proxy, no restart.
# Its rows: the exact view, today's estimate, a cache-blind policy, a peer's cache-aware router.
CACHE_ROWS = ("la-swrr+events", "la-swrr", "rr", "sglang-router:cache_aware")
REAL_BLOCK_TOKENS = 128  # the CPU backend's KV block (--num-gpu-blocks-override counts these)
REAL_CACHE_BLOCKS = 28  # 3,584 tokens each; the room must hold one 2,048-token request
REAL_CHAT = ChatSpec(conversations_per_s=0.4, system_prompts=4, system_words=260, turns_min=2, turns_max=6,
                     user_words=30, assistant_words=40, think_min_s=3.0, think_s=5.0, max_tokens=24,
                     second_entry_share=0.3)
REAL_CACHE = Scenario(
    name="cache",
    description=f"3 real vLLM (CPU, tiny model): 8, 4, 2 slots, {REAL_CACHE_BLOCKS}-block KV rooms (evicting), "
                "KV events; chats over 4 shared system prompts, 2-6 turns; vllm-8 restarted at 20 s; 30 % of the "
                "requests through a second proxy sharing nothing with the first",
    engines=REAL_ENGINES,
    # a restart takes 60-190 s on this 2-core machine (the engine is ejected meanwhile): the run
    # lasts long enough for vllm-8 to serve again well before its end
    phases=(Phase("warm", 0.0, 20.0), Phase("after-restart", 20.0, 200.0)),
    actions=(Action(20.0, "restart", "vllm-8", None, label="vllm-8 restarted"),),
    util=0.0,
    speed=1.0,
    focus_phase="after-restart",
    kv_tokens=REAL_CACHE_BLOCKS * REAL_BLOCK_TOKENS,
    chat=REAL_CHAT,
    proxies=2,
    proxy_args=("--peer-interval-ms", "0"),
    kv_events=True,
    rows=CACHE_ROWS,
)
REAL_CACHE_PLAIN = replace(
    REAL_CACHE, name="cache-plain", actions=(), proxies=1, proxy_args=(), rows=CACHE_ROWS[:2],
    phases=(Phase("warm", 0.0, 20.0), Phase("steady", 20.0, 200.0)), focus_phase="steady",
    description=f"the cache scenario's engines ({REAL_CACHE_BLOCKS}-block KV rooms, KV events) and workload, "
                "through one proxy, no restart; rows la-swrr+events and la-swrr")

# ``cache-reset``: the cache scenario with vllm-8's prefix cache emptied at 20 s instead of a restart.
# A restart on this machine takes 36-123 s, longer than it takes to eject the node, and an ejected
# node's prefixes are forgotten by both views: the restart then tells the estimated view as much as
# the exact one. A cache emptied while the engine serves on (what a restart within seconds does on a
# fast host) is told only by the engine's AllBlocksCleared.
REAL_CACHE_RESET = replace(
    REAL_CACHE, name="cache-reset", actions=(Action(20.0, "cache_reset", "vllm-8", None,
                                                    label="vllm-8's prefix cache emptied"),),
    phases=(Phase("warm", 0.0, 20.0), Phase("after-reset", 20.0, 200.0)), focus_phase="after-reset",
    description=f"the cache scenario ({REAL_CACHE_BLOCKS}-block KV rooms, KV events, two proxies) with vllm-8's "
                "prefix cache emptied at 20 s while it serves on, in place of its restart")

# ``cache-busy``: ``cache-plain`` at three times the conversations, so the engines queue: a request
# then waits seconds between its pick and its prefill, while another of its system prompt is picked;
# the rows are the exact view with and without the blocks of requests in flight (KvIndex, "In flight").
REAL_CACHE_BUSY = replace(
    REAL_CACHE_PLAIN, name="cache-busy", chat=replace(REAL_CHAT, conversations_per_s=1.2),
    rows=("la-swrr+events", "la-swrr+events-in-flight"),
    description=f"the cache-plain scenario ({REAL_CACHE_BLOCKS}-block KV rooms, KV events, one proxy) at three times "
                "the conversations, so the engines queue; rows la-swrr+events and la-swrr+events-in-flight")

REAL_SCENARIOS: dict[str, Scenario] = {s.name: s for s in (REAL_HETEROGENEOUS, REAL_ANNOUNCED_DROP, REAL_CACHE,
                                                           REAL_CACHE_PLAIN, REAL_CACHE_RESET, REAL_CACHE_BUSY)}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}") from None

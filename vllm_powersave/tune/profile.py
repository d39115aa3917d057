"""Profile prefill, decode and mixed steps of a model's modules with vLLM-equal shapes.

The model is read from a Hugging Face ``config.json`` (e.g. a directory made by ``vllm-powersave
make-model``); no weights are loaded. One decoder layer is built from plain torch tensors with the
shapes vLLM uses (fused ``qkv_proj`` and ``gate_up_proj``, GQA, RoPE, RMSNorm, SiLU-and-mul), run
under ``torch.profiler`` and multiplied by the layer count, as seed 000 did (Spaan et al., arXiv
2601.08539: "one layer measured x24"). After the layers: final norm, the LM head on the sampled rows
only (vLLM's ``logits_indices``: one row per request) and vLLM's random sampler (fp32 softmax and
the exponential race ``argmax(p / q)``). RoPE and SiLU-and-mul run as unfused torch ops where vLLM
has fused kernels, so the elementwise group's time share is an upper bound of vLLM's.

Every op carries two labels:

* ``kind`` -- the issue's kernel groups: ``gemm``, ``attention``, ``elementwise`` (norms,
  RoPE, activations, residual adds), ``lm_head``, ``sampling``, ``communication``;
* ``region`` -- the contiguous code regions that a clock preset can follow (the settings schema's
  kernel groups): ``attention`` (norm, QKV, RoPE, attention, O-proj, per layer), ``mlp`` (norm,
  gate-up, activation, down, per layer), ``lm_head``, ``sampling`` (per step).

FLOPs and HBM bytes come from the shapes (bf16 weights and activations, as on a GPU), giving each
group's arithmetic intensity; a group is compute-bound if its intensity reaches the ridge point
``peak FLOP/s / bandwidth`` of the GPU's ceilings (measured on a GPU, else the simulated H200's).
Communication (tensor parallelism > 1) is not run on one device: its time is modelled from the
all-reduce bytes at NVLink bandwidth and labelled so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sim.ceilings import Ceilings, simulated_ceilings
from ..sim.gpu import H200, GpuSpec
from .energy import SIM_KERNEL_OVERHEAD_S, simulated_kernels

KINDS: tuple[str, ...] = ("gemm", "attention", "elementwise", "lm_head", "sampling", "communication")
REGIONS: tuple[str, ...] = ("attention", "mlp", "lm_head", "sampling")
#: NVLink 4 on the H200: 900 GB/s bidirectional, i.e. 450 GB/s each way (vendor datasheet).
NVLINK_BW = 450e9
DTYPE_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of a decoder-only model (from ``config.json``)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qkv_bias: bool

    @classmethod
    def from_dir(cls, model: str | Path) -> "ModelShape":
        """Read ``MODEL/config.json``.

        Raises:
            ValueError: one line naming the model path or the missing/invalid field.
        """
        p = Path(model)
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.is_file():
            raise ValueError(f"model {str(model)!r}: no config.json found (give a Hugging Face model directory)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model {str(model)!r}: cannot read config.json: {exc}") from None
        name = p.name if p.is_dir() else (p.parent.name if p.name == "config.json" else p.stem)
        return cls.from_config(cfg, name=name)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "model") -> "ModelShape":
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json = {str(cfg)[:60]!r}: must be a JSON object")
        cfg = cfg.get("text_config", cfg)
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json field 'text_config' = {str(cfg)[:60]!r}: must be a JSON object")

        def need(key: str, default: int | None = None) -> int:
            v = cfg.get(key)
            if v is None and default is not None:
                return default
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"config.json field {key!r} = {v!r}: must be a positive integer")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv = need("num_key_value_heads", heads)
        head_dim = need("head_dim", max(1, hidden // heads))
        mt = str(cfg.get("model_type", ""))
        return cls(
            name=name,
            hidden=hidden,
            layers=need("num_hidden_layers"),
            heads=heads,
            kv_heads=int(kv),
            head_dim=int(head_dim),
            intermediate=need("intermediate_size"),
            vocab=need("vocab_size"),
            qkv_bias=bool(cfg.get("attention_bias", mt.startswith("qwen2"))),
        )

    def sharded(self, tp: int) -> "ModelShape":
        """Per-rank shapes under tensor parallelism ``tp`` (vLLM: heads, KV heads (>= 1), MLP, vocab split)."""
        if tp == 1:
            return self
        if self.heads % tp:
            raise ValueError(f"tp = {tp}: does not divide num_attention_heads = {self.heads}")
        return dataclasses.replace(
            self,
            heads=self.heads // tp,
            kv_heads=max(1, self.kv_heads // tp),
            intermediate=math.ceil(self.intermediate / tp),
            vocab=math.ceil(self.vocab / tp),
        )


@dataclass(frozen=True)
class StepSpec:
    """One engine step: ``prompts`` prefill sequences of ``prompt_len`` tokens (context 0) plus
    ``decodes`` decoding sequences with ``ctx`` cached tokens each. LM-head rows: one per sequence
    that samples (every decode, every prompt: its last row)."""

    phase: str
    prompts: int = 0
    prompt_len: int = 0
    decodes: int = 0
    ctx: int = 0

    @property
    def tokens(self) -> int:
        return self.prompts * self.prompt_len + self.decodes

    @property
    def lm_rows(self) -> int:
        return self.prompts + self.decodes


def default_steps(gpu: bool) -> list[StepSpec]:
    """Representative steps: a 2048-token prefill, a 64-request decode at 1024 context, and a
    chunked-prefill mixed step (32 decodes + a 512-token chunk). Smaller on a CPU (time)."""
    if gpu:
        return [
            StepSpec("prefill", prompts=4, prompt_len=512),
            StepSpec("decode", decodes=64, ctx=1024),
            StepSpec("mixed", prompts=1, prompt_len=512, decodes=32, ctx=1024),
        ]
    return [
        StepSpec("prefill", prompts=2, prompt_len=128),
        StepSpec("decode", decodes=32, ctx=512),
        StepSpec("mixed", prompts=1, prompt_len=128, decodes=16, ctx=512),
    ]


@dataclass
class Op:
    """One kernel-level operation: labels, FLOPs and HBM bytes (bf16), and how often it runs per step."""

    name: str
    kind: str
    region: str
    flops: float
    nbytes: float
    per_layer: bool
    fn: Callable[[], Any] | None = None  # None: modelled only (communication)
    model_time_s: float | None = None  # for modelled ops


def measure_ceilings(torch: Any, device: Any, seconds: float = 0.3) -> Ceilings:
    """Measured bf16 GEMM rate (8192^3) and device-copy bandwidth (1 GiB) on a CUDA device."""

    def rate(fn: Callable[[], Any], work: float) -> float:
        fn()
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
            if n % 4 == 0:
                torch.cuda.synchronize()
        e.record()
        torch.cuda.synchronize()
        return work * n / (s.elapsed_time(e) / 1000)

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flops = rate(lambda: a @ b, 2 * 8192**3)
    src = torch.empty(2**29, device=device, dtype=torch.int16)
    dst = torch.empty_like(src)
    bw = rate(lambda: dst.copy_(src), 2 * 2**30)
    return Ceilings(flops, bw, f"measured on this GPU ({seconds:.1f} s bursts: bf16 GEMM 8192^3, 1 GiB device copy)")


def build_ops(
    shape: ModelShape, step: StepSpec, torch: Any | None = None, device: Any = "cpu", dtype: Any = None, tp: int = 1, seed: int = 0
) -> list[Op]:
    """The ops of one step: one decoder layer (``per_layer``), then final norm, LM head, sampling.

    With ``torch`` given, each op gets a callable on real tensors of the (per-rank) shapes; without,
    only labels, FLOPs and bytes (for tests and the simulator).
    """
    s = shape.sharded(tp)
    H, hd, T = s.hidden, s.head_dim, step.tokens
    Q, K, I, V, R = s.heads * hd, s.kv_heads * hd, s.intermediate, s.vocab, step.lm_rows
    B = DTYPE_BYTES

    def gemm_cost(m: int, k: int, n: int) -> tuple[float, float]:
        return 2.0 * m * k * n, float(B * (m * k + k * n + m * n))

    # Attention: causal prefill (half of the L x L scores), decode reads the KV cache of ctx tokens.
    att_flops = step.prompts * 2.0 * 2 * step.prompt_len**2 * hd * s.heads / 2 + step.decodes * 2.0 * 2 * (step.ctx + 1) * hd * s.heads
    att_bytes = float(B * (T * (2 * Q + 2 * K) + step.decodes * (step.ctx + 1) * 2 * K))
    specs: list[tuple[str, str, str, float, float, bool]] = [
        ("input_layernorm", "elementwise", "attention", 4.0 * T * H, float(B * (2 * T * H + H)), True),
        ("qkv_proj", "gemm", "attention", *gemm_cost(T, H, Q + 2 * K), True),
        ("rotary_emb", "elementwise", "attention", 3.0 * T * (Q + K), float(B * 2 * T * (Q + K)), True),
        ("attn", "attention", "attention", att_flops, att_bytes, True),
        ("o_proj", "gemm", "attention", *gemm_cost(T, Q, H), True),
        ("residual_add_attn", "elementwise", "attention", float(T * H), float(B * 3 * T * H), True),
        ("post_attention_layernorm", "elementwise", "mlp", 4.0 * T * H, float(B * (2 * T * H + H)), True),
        ("gate_up_proj", "gemm", "mlp", *gemm_cost(T, H, 2 * I), True),
        ("silu_and_mul", "elementwise", "mlp", 5.0 * T * I, float(B * 3 * T * I), True),
        ("down_proj", "gemm", "mlp", *gemm_cost(T, I, H), True),
        ("residual_add_mlp", "elementwise", "mlp", float(T * H), float(B * 3 * T * H), True),
        ("final_norm", "elementwise", "lm_head", 4.0 * T * H, float(B * (2 * T * H + H)), False),
        ("gather_rows", "elementwise", "lm_head", 0.0, float(B * 2 * R * H), False),
        ("lm_head", "lm_head", "lm_head", *gemm_cost(R, H, V), False),
        # vLLM's sampler: logits to fp32, temperature, softmax, exponential race argmax(p / q).
        ("logits_fp32_temperature", "sampling", "sampling", float(R * V), float(R * V * (B + 4 + 4 + 4)), False),
        ("softmax", "sampling", "sampling", 5.0 * R * V, float(R * V * 12), False),
        ("exponential_race_argmax", "sampling", "sampling", 2.0 * R * V, float(R * V * 12), False),
    ]
    ops = [Op(n, k, r, f, b, pl) for n, k, r, f, b, pl in specs]
    if tp > 1:
        ar = 2.0 * (tp - 1) / tp * B * T * H
        for after, region in (("o_proj", "attention"), ("down_proj", "mlp")):
            i = next(j for j, o in enumerate(ops) if o.name == after)
            ops.insert(i + 1, Op(f"all_reduce_{region}", "communication", region, float(T * H), ar, True, None, ar / NVLINK_BW))
        lm = next(j for j, o in enumerate(ops) if o.name == "lm_head")
        ag = (tp - 1) / tp * B * R * V * tp
        ops.insert(lm + 1, Op("all_gather_logits", "communication", "lm_head", 0.0, ag, False, None, ag / NVLINK_BW))
    if torch is not None:
        _attach_fns(ops, torch, s, step, device, dtype or torch.float32, seed)
    return ops


def _sdpa(F: Any, q: Any, k: Any, v: Any, rep: int, causal: bool) -> Any:
    """Causal SDPA with grouped-query attention (``enable_gqa`` where torch has it, else repeated KV)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=rep > 1)
    except TypeError:  # torch < 2.5
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)


def _attention(F: Any, torch: Any, st: dict[str, Any], s: ModelShape, step: StepSpec, kv_cache: Any) -> None:
    """The attention op of :func:`_attach_fns`: causal SDPA per prompt, then the decodes over their KV cache."""
    hd = s.head_dim
    Q, K = s.heads * hd, s.kv_heads * hd
    qkv = st["qkv"]
    q = st["qk_rot"][:, : s.heads].transpose(0, 1)  # [heads, T, hd]
    outs = []
    n = 0
    rep = s.heads // s.kv_heads
    for _ in range(step.prompts):
        L = step.prompt_len
        # 4-D [1, heads, L, hd] with GQA: the flash/cuDNN backends apply (3-D inputs fall back
        # to the fp32 math path on CUDA, which is not what vLLM runs).
        k = st["qk_rot"][n : n + L, s.heads :].transpose(0, 1)[None]
        v = qkv[n : n + L, Q + K :].view(L, s.kv_heads, hd).transpose(0, 1)[None]
        o = _sdpa(F, q[None, :, n : n + L], k, v, rep, causal=True)
        outs.append(o[0].transpose(0, 1).reshape(L, Q))
        n += L
    if step.decodes:
        qd = q[:, n : n + step.decodes].transpose(0, 1).reshape(step.decodes, s.kv_heads, rep, hd)
        kc, vc = kv_cache[..., :hd], kv_cache[..., hd:]
        o = F.scaled_dot_product_attention(qd, kc, vc)  # [decodes, kv_heads, rep, hd] over ctx
        outs.append(o.reshape(step.decodes, Q))
    st["attn"] = torch.cat(outs) if len(outs) > 1 else outs[0]


def _attach_fns(ops: list[Op], torch: Any, s: ModelShape, step: StepSpec, device: Any, dtype: Any, seed: int) -> None:
    F = torch.nn.functional
    g = torch.Generator(device="cpu").manual_seed(seed)
    H, hd, T, R = s.hidden, s.head_dim, step.tokens, step.lm_rows
    Q, K, I, V = s.heads * hd, s.kv_heads * hd, s.intermediate, s.vocab

    def rnd(*shape: int, scale: float = 0.02) -> Any:
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x, resid = rnd(T, H, scale=1.0), rnd(T, H, scale=1.0)
    w_norm = torch.ones(H, device=device, dtype=dtype)
    w_qkv, b_qkv = rnd(Q + 2 * K, H), (rnd(Q + 2 * K) if s.qkv_bias else None)
    w_o, w_gu, w_down, w_lm = rnd(H, Q), rnd(2 * I, H), rnd(H, I), rnd(V, H)
    kv_cache = rnd(step.decodes, s.kv_heads, step.ctx + 1, 2 * hd, scale=1.0) if step.decodes else None
    cos, sin = rnd(T, hd // 2, scale=1.0), rnd(T, hd // 2, scale=1.0)
    rows = torch.arange(R, device=device) * max(1, T // max(R, 1))
    st: dict[str, Any] = {}

    def rms(t: Any) -> Any:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(t, (H,), w_norm, 1e-6)
        v = t.float().pow(2).mean(-1, keepdim=True)
        return (t.float() * torch.rsqrt(v + 1e-6)).to(dtype) * w_norm

    def rope() -> None:
        qk = st["qkv"][:, : Q + K].view(T, -1, hd)
        a, b = qk[..., : hd // 2], qk[..., hd // 2 :]
        c, sn = cos[:, None, :], sin[:, None, :]
        st["qk_rot"] = torch.cat((a * c - b * sn, b * c + a * sn), dim=-1)

    def sample_prep() -> None:
        st["p"] = st["logits"].float().div_(0.8)

    def race() -> None:
        q = torch.empty_like(st["p"]).exponential_()
        st["tok"] = st["p"].div_(q).argmax(-1)

    fns: dict[str, Callable[[], Any]] = {
        "input_layernorm": lambda: st.__setitem__("h", rms(x)),
        "qkv_proj": lambda: st.__setitem__("qkv", F.linear(st["h"], w_qkv, b_qkv)),
        "rotary_emb": rope,
        "attn": lambda: _attention(F, torch, st, s, step, kv_cache),
        "o_proj": lambda: st.__setitem__("o", F.linear(st["attn"], w_o)),
        "residual_add_attn": lambda: st.__setitem__("r", st["o"] + resid),
        "post_attention_layernorm": lambda: st.__setitem__("h2", rms(st["r"])),
        "gate_up_proj": lambda: st.__setitem__("gu", F.linear(st["h2"], w_gu)),
        "silu_and_mul": lambda: st.__setitem__("act", F.silu(st["gu"][:, :I]) * st["gu"][:, I:]),
        "down_proj": lambda: st.__setitem__("d", F.linear(st["act"], w_down)),
        "residual_add_mlp": lambda: st.__setitem__("out", st["d"] + st["r"]),
        "final_norm": lambda: st.__setitem__("fn", rms(st["out"])),
        "gather_rows": lambda: st.__setitem__("sel", st["fn"].index_select(0, rows)),
        "lm_head": lambda: st.__setitem__("logits", F.linear(st["sel"], w_lm)),
        "logits_fp32_temperature": sample_prep,
        "softmax": lambda: st.__setitem__("p", torch.softmax(st["p"], dim=-1)),
        "exponential_race_argmax": race,
    }
    for op in ops:
        if op.model_time_s is None:
            op.fn = fns[op.name]


@dataclass
class GroupStats:
    """Totals of one group in one step: seconds, FLOPs, bytes; derived share, intensity and bound."""

    time_s: float = 0.0
    flops: float = 0.0
    nbytes: float = 0.0
    sim_time_s: float = 0.0
    share: float = 0.0
    ops: list[str] = field(default_factory=list)
    kernels: dict[str, float] = field(default_factory=dict)
    modelled: bool = False

    @property
    def intensity(self) -> float:
        return self.flops / self.nbytes if self.nbytes else 0.0


@dataclass
class StepProfile:
    """Profile of one step: ops with per-call time (s, over all layers), group totals by kind and region."""

    step: StepSpec
    ops: list[dict]
    kinds: dict[str, GroupStats]
    regions: dict[str, GroupStats]
    total_s: float
    sim_total_s: float


def _event_time_us(ev: Any, gpu: bool) -> float:
    if gpu:
        return float(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    return float(ev.cpu_time_total)


def _kernels_under(ev: Any, out: dict[str, float]) -> None:
    for k in getattr(ev, "kernels", []) or []:
        out[k.name] = out.get(k.name, 0.0) + float(k.duration)
    for ch in getattr(ev, "cpu_children", []) or []:
        _kernels_under(ch, out)


def profile_step(
    shape: ModelShape,
    step: StepSpec,
    *,
    torch: Any,
    device: Any,
    dtype: Any,
    ceilings: Ceilings,
    tp: int = 1,
    warmup: int = 2,
    repeats: int = 3,
    sim_spec: GpuSpec = H200,
) -> StepProfile:
    """Run one step's ops ``warmup + repeats`` times, the last ``repeats`` under ``torch.profiler``.

    Time per op: device time of the kernels inside its ``record_function`` scope (GPU) or CPU time
    (CPU), averaged over repeats, times the layer count for per-layer ops. ``sim_time_s``: the
    simulated H200's time for the same FLOPs and bytes at the default clock (simulated).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    gpu = torch.device(device).type == "cuda"
    ops = build_ops(shape, step, torch, device, dtype, tp)
    runnable = [o for o in ops if o.fn is not None]

    def once(tag: bool) -> None:
        for o in runnable:
            if tag:
                with record_function(f"ps|{o.name}"):
                    o.fn()
            else:
                o.fn()

    with torch.no_grad():
        for _ in range(warmup):
            once(False)
        if gpu:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) as prof:
            for _ in range(repeats):
                once(True)
            if gpu:
                torch.cuda.synchronize()
    t_us: dict[str, float] = {}
    kernels: dict[str, dict[str, float]] = {}
    for ev in prof.events():
        if not ev.name.startswith("ps|"):
            continue
        name = ev.name[3:]
        t_us[name] = t_us.get(name, 0.0) + _event_time_us(ev, gpu)
        if gpu:
            _kernels_under(ev, kernels.setdefault(name, {}))
    rows = []
    for o in ops:
        mult = shape.layers if o.per_layer else 1
        t1 = o.model_time_s if o.fn is None else t_us.get(o.name, 0.0) / 1e6 / repeats
        sim_t, _ = simulated_kernels([(o.flops, o.nbytes)], spec=sim_spec) if o.fn is not None else (o.model_time_s or 0.0, 0.0)
        rows.append(
            {
                "name": o.name,
                "kind": o.kind,
                "region": o.region,
                "per_layer": o.per_layer,
                "layers": mult,
                "time_s": t1 * mult,
                "time_per_call_s": t1,
                "sim_time_s": sim_t * mult,
                "flops": o.flops * mult,
                "bytes": o.nbytes * mult,
                "flops_per_call": o.flops,
                "bytes_per_call": o.nbytes,
                "modelled": o.fn is None,
                "kernels": {k: v / repeats * mult / 1e6 for k, v in sorted(kernels.get(o.name, {}).items(), key=lambda kv: -kv[1])[:5]},
            }
        )
    return _aggregate(step, rows, ceilings)


def _aggregate(step: StepSpec, rows: list[dict], ceilings: Ceilings) -> StepProfile:
    kinds = {k: GroupStats() for k in KINDS}
    regions = {r: GroupStats() for r in REGIONS}
    for r in rows:
        for table, key in ((kinds, r["kind"]), (regions, r["region"])):
            gs = table[key]
            gs.time_s += r["time_s"]
            gs.sim_time_s += r["sim_time_s"]
            gs.flops += r["flops"]
            gs.nbytes += r["bytes"]
            gs.ops.append(r["name"])
            gs.modelled = gs.modelled or r["modelled"]
            for k, v in r["kernels"].items():
                gs.kernels[k] = gs.kernels.get(k, 0.0) + v
    total = sum(r["time_s"] for r in rows)
    sim_total = sum(r["sim_time_s"] for r in rows)
    for table in (kinds, regions):
        for gs in table.values():
            gs.share = gs.time_s / total if total else 0.0
    return StepProfile(step, rows, kinds, regions, total, sim_total)


def bound_label(intensity: float, ceilings: Ceilings) -> str:
    """ "compute-bound" if ``intensity`` (FLOP/B) reaches the ceilings' ridge point, else "memory-bound"."""
    return "compute-bound" if intensity >= ceilings.ridge else "memory-bound"


def group_table(sp: StepProfile, ceilings: Ceilings, by: str = "kinds") -> list[dict]:
    """Rows for reports: group, time share, time (s), FLOPs, bytes, intensity, bound label."""
    out = []
    for name, gs in getattr(sp, by).items():
        if not gs.ops:
            continue
        out.append(
            {
                "group": name,
                "share": gs.share,
                "time_s": gs.time_s,
                "sim_time_s": gs.sim_time_s,
                "flops": gs.flops,
                "bytes": gs.nbytes,
                "intensity": gs.intensity,
                "bound": bound_label(gs.intensity, ceilings) if gs.nbytes else "-",
                "modelled": gs.modelled,
                "ops": list(gs.ops),
                "top_kernels": dict(list(sorted(gs.kernels.items(), key=lambda kv: -kv[1]))[:3]),
            }
        )
    return out


def region_durations_ms(sp: StepProfile, layers: int, use_sim: bool) -> dict[str, float]:
    """Contiguous duration of each region (ms): per layer for attention and MLP, per step otherwise."""
    out = {}
    for name, gs in sp.regions.items():
        t = gs.sim_time_s if use_sim else gs.time_s
        out[name] = 1000.0 * (t / layers if name in ("attention", "mlp") else t)
    return out


__all__ = [
    "KINDS",
    "REGIONS",
    "Ceilings",
    "ModelShape",
    "StepSpec",
    "StepProfile",
    "build_ops",
    "default_steps",
    "group_table",
    "measure_ceilings",
    "profile_step",
    "region_durations_ms",
    "simulated_ceilings",
    "SIM_KERNEL_OVERHEAD_S",
]

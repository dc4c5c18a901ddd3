"""Context parallelism on two H200s over NCCL: correctness and scaling of FLUX.2 with PictorAttn.

Every rank builds the same seeded random-weight FLUX.2 transformer once per model (bf16, built on its own GPU;
float32 on CPU, over gloo, for the tests), checks that all ranks hold identical weights, and runs each case,
processor and mode on it:

* cases: "2048" is a 2048² image (16384 image tokens); "1024+ref" a 1024² image plus one 1024² reference image
  (4096 + 4096 image tokens: as diffusers' Flux2Pipeline passes editing references, their latents follow the
  image's and their ids carry time 10, `_prepare_image_ids`); each with 512 text tokens. Any "<side>" or
  "<side>+ref" works, side a multiple of 16 (8x VAE, 2x2 packing): "64" is 16 image tokens.
* processors: `stock` (diffusers' processors on its native backend, SDPA; under ring attention on CUDA
  `_native_cudnn`, since ring attention merges shards by their log-sum-exp and native SDPA returns none. No CPU
  backend of diffusers returns one either, so stock ring fails on CPU, recorded as that row's error);
  `pictor_fp32`, `pictor_bf16`, `pictor_fp8` (`PictorAttn(precision=...)`).
* modes: `single` (no parallelism: every rank runs the whole forward alone, as one GPU would), `ulysses`
  (`ContextParallelConfig(ulysses_degree=world)`), `ring` (`ring_degree=world`), through
  `model.enable_parallelism`; each mode's device mesh is made once and reused.

Per row: `ms`, the median of `--reps` forwards after `--warmup`, each started on every rank together (a barrier)
and timed by CUDA events (perf_counter on CPU), each rep's time its slowest rank's. `speedup_vs_single` (single
ms / ms, same processor; stock ring runs cuDNN, stock single native SDPA), `x_stock_same_mode` (ms / stock's ms in
the same mode), and rank 0's output (the whole sequence, which diffusers gathers on every rank) against single of
the same processor and single stock.
`max_abs_across_ranks`: every rank's output against rank 0's. `restored_max_abs` (single rows): a single forward
after the parallel modes against the first; `enable_parallelism` has no inverse and refuses a second call, so
`disable_parallelism` removes its hooks and configs, and this checks that it leaves the model as it was.
`peak_gib`: peak GPU memory of the row, max over ranks (dev: 60 GiB of weights on every rank).

A row that raises (OOM, a backend that cannot serve the mode) is recorded as {"error": ...} on every rank and the
run goes on; ranks agree after each row. A failure on one rank inside a collective its peer waits in ends only
with the process group's timeout (`--timeout-s`). Rank 0 prints the table and writes the JSON.

    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --models klein-9B,dev --cases 2048,1024+ref \
        --json benchmarks/results/h200x2_context_parallel.json
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --device cpu --models tiny --cases 64 --reps 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import diffusers
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from bench_kernel import environment
from bench_model import MODEL_CONFIGS, TEXT_TOKENS, set_backend
from diffusers import ContextParallelConfig, Flux2Transformer2DModel
from diffusers.hooks.context_parallel import remove_context_parallel
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, image_ids, transformer_inputs
from pictor_diffusers.testing.references import max_abs, rel_l2

MODELS = {"tiny": TINY_CONFIG, **{name: MODEL_CONFIGS[name] for name in ("klein-4B", "klein-9B", "dev")}}
PROCESSORS = ("stock", "pictor_fp32", "pictor_bf16", "pictor_fp8")
MODES = ("single", "ulysses", "ring")
STOCK_RING_BACKEND = "_native_cudnn"
"""diffusers' backend for stock ring attention on CUDA: cuDNN SDPA, which returns the log-sum-exp."""
PIXELS_PER_TOKEN = 16
REFERENCE_TIME = 10
"""Time id of the first reference image: diffusers' `Flux2Pipeline._prepare_image_ids` (scale + scale * 0)."""
INT_VIEW = {2: torch.int16, 4: torch.int32}
HEADER = (
    f"{'model':>9} {'case':>9} {'tokens':>6} {'processor':>12} {'mode':>8} {'ms':>9} {'x single':>8} {'x stock':>8} "
    f"{'rel_l2':>9} {'max_abs':>9} {'vs stock':>9} {'GiB':>7}"
)
"""Table columns: rel_l2 and max_abs against single of the same processor; vs stock: rel_l2 against single stock."""


class Case(NamedTuple):
    name: str
    side: int  # latent tokens per image side
    references: int

    def tokens(self, text_tokens: int) -> int:
        return text_tokens + self.side**2 * (1 + self.references)


@dataclass
class Results:
    """One case's outputs and times so far: references for the rows that follow."""

    single: dict[str, torch.Tensor] = field(default_factory=dict)  # processor -> single output
    ms: dict[tuple[str, str], float] = field(default_factory=dict)  # (processor, mode) -> ms
    rows: list[dict] = field(default_factory=list)


def parse_case(text: str) -> Case:
    size, _, suffix = text.partition("+")
    if not size.isdigit() or int(size) % PIXELS_PER_TOKEN or suffix not in ("", "ref"):
        raise SystemExit(f"a case is '<side>' or '<side>+ref', side a multiple of {PIXELS_PER_TOKEN}; got {text!r}")
    return Case(text, int(size) // PIXELS_PER_TOKEN, int(suffix == "ref"))


def case_inputs(model: Flux2Transformer2DModel, case: Case, text_tokens: int) -> dict:
    """Seeded inputs: image latents, then the references'; ids 3-D `[1, N, 4]` as FLUX.2's pipelines pass them
    (diffusers' cp plan splits only those)."""
    inputs = transformer_inputs(model, 1, (case.side, case.side), text_tokens)
    hidden, ids = [inputs["hidden_states"]], [inputs["img_ids"]]
    generator = torch.Generator().manual_seed(2)
    for index in range(case.references):
        hidden.append(torch.randn(hidden[0].shape, generator=generator).to(hidden[0]))
        reference_ids = image_ids(case.side, case.side)
        reference_ids[:, 0] = REFERENCE_TIME * (index + 1)
        ids.append(reference_ids.to(ids[0]))
    inputs["hidden_states"] = torch.cat(hidden, dim=1)
    inputs["img_ids"] = torch.cat(ids)[None]
    inputs["txt_ids"] = inputs["txt_ids"][None]
    return inputs


def init_distributed(device_type: str, timeout_s: float) -> torch.device:
    """This rank's device, its process group up (NCCL on CUDA, gloo on CPU)."""
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    torch.accelerator.device_count = lambda: 1  # diffusers places rank r on device r % count; 0 on CPU
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def make_meshes(device: torch.device, world: int) -> dict[str, DeviceMesh]:
    """The ("ring", "ulysses") device mesh of each parallel mode, made once: a fresh config per row reuses it."""
    shapes = {"ulysses": (1, world), "ring": (world, 1)}
    return {
        mode: init_device_mesh(device.type, shape, mesh_dim_names=("ring", "ulysses")) for mode, shape in shapes.items()
    }


def build_model(name: str, device: torch.device) -> tuple[Flux2Transformer2DModel, bool]:
    """(the seeded model: bf16 built on the GPU, float32 on CPU; whether rank 0 had to broadcast its weights)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = build_transformer(MODELS[name], dtype=dtype)
    finally:
        torch.set_default_dtype(torch.float32)
    return model, share_weights(model)


def share_weights(model: torch.nn.Module) -> bool:
    """Compare exact integer checksums of every parameter across ranks; where any differs, broadcast rank 0's
    weights. Returns whether it had to."""
    sums = torch.stack([p.detach().view(INT_VIEW[p.element_size()]).sum(dtype=torch.int64) for p in model.parameters()])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    if all(torch.equal(other, gathered[0]) for other in gathered):
        return False
    for parameter in model.parameters():
        dist.broadcast(parameter.data, 0)
    return True


def set_processor(model: torch.nn.Module, processor: str, mode: str, device: torch.device) -> str:
    """Put `processor` on `model` for `mode`; returns the attention backend it runs on."""
    if processor == "stock" and mode == "ring" and device.type == "cuda":
        set_backend(model, f"backend_{STOCK_RING_BACKEND}")
        return STOCK_RING_BACKEND
    set_backend(model, processor)
    return "pictor" if processor.startswith("pictor_") else "native"


def disable_parallelism(model: torch.nn.Module) -> None:
    """Undo `enable_parallelism`, which diffusers cannot: remove its split and gather hooks and forget the config
    it recorded on the model and its processors."""
    remove_context_parallel(model, model._cp_plan)
    model._parallel_config = None
    for processor in model.attn_processors.values():
        if getattr(processor, "_parallel_config", None) is not None:
            processor._parallel_config = None


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The model's output, complete: diffusers' gather hook returns an AsyncCollectiveTensor, waited for here so
    that the time of a forward includes its gather."""
    out = model(**inputs)[0]
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def timed_forward(model: torch.nn.Module, inputs: dict, device: torch.device) -> tuple[torch.Tensor, float]:
    """(output, ms) of one forward started on every rank together."""
    if device.type != "cuda":
        dist.barrier()
        start = time.perf_counter()
        out = forward(model, inputs)
        return out, (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = forward(model, inputs)
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def measure(model: torch.nn.Module, inputs: dict, warmup: int, reps: int, device: torch.device) -> dict:
    """The last output, the median over reps of each rep's slowest rank (ms), the spread across ranks and peak
    memory."""
    for _ in range(warmup):
        forward(model, inputs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = [timed_forward(model, inputs, device) for _ in range(reps)]
    out = runs[-1][0]
    first = out.contiguous().clone()
    dist.broadcast(first, 0)
    peak = max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, device) if device.type == "cuda" else None
    return {
        "out": out,
        "ms": statistics.median(max_over_ranks(ms, device) for _, ms in runs),
        "max_abs_across_ranks": max_over_ranks(max_abs(out, first), device),
        "peak_gib": peak,
    }


def run_row(
    model: torch.nn.Module, inputs: dict, processor: str, mode: str, mesh: DeviceMesh | None, args: argparse.Namespace
) -> dict:
    """`measure`'s result plus "attention_backend", or {"error": ...} on every rank where any rank raised."""
    device = next(model.parameters()).device
    try:
        backend = set_processor(model, processor, mode, device)
        if mesh is not None:
            degree = {"ulysses_degree" if mode == "ulysses" else "ring_degree": mesh.size()}
            model.enable_parallelism(config=ContextParallelConfig(**degree, mesh=mesh))
        result = {**measure(model, inputs, args.warmup, args.reps, device), "attention_backend": backend}
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    finally:
        disable_parallelism(model)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, result.get("error"))
    failed = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error is not None]
    if failed:
        result = {"error": "; ".join(failed)}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def add_row(results: Results, row: dict, processor: str, mode: str, result: dict) -> None:
    """Fill `row` from `result` against the case's single outputs and stock times so far."""
    if "error" in result:
        results.rows.append({**row, **result})
        return
    out, ms = result.pop("out"), result["ms"]
    if mode == "single":
        results.single[processor] = out
    results.ms[processor, mode] = ms
    single, stock = results.single.get(processor), results.single.get("stock")
    single_ms, stock_ms = results.ms.get((processor, "single")), results.ms.get(("stock", mode))
    row |= {
        "ms": ms,
        "speedup_vs_single": None if single_ms is None else single_ms / ms,
        "x_stock_same_mode": None if stock_ms is None else ms / stock_ms,
        "rel_l2_vs_single_same_processor": None if single is None else rel_l2(out, single),
        "max_abs_vs_single_same_processor": None if single is None else max_abs(out, single),
        "rel_l2_vs_single_stock": None if stock is None else rel_l2(out, stock),
        "finite": bool(torch.isfinite(out).all()),
        "output_tokens": out.shape[1],
        **result,
    }
    results.rows.append(row)


def bench_case(
    model: Flux2Transformer2DModel, name: str, case: Case, meshes: dict[str, DeviceMesh], args: argparse.Namespace
) -> list[dict]:
    inputs = case_inputs(model, case, args.text_tokens)
    results = Results()
    world = dist.get_world_size()
    for processor in args.processors:
        for mode in args.modes:
            row = {"model": name, "case": case.name, "tokens": case.tokens(args.text_tokens), "processor": processor}
            row |= {"mode": mode, "world_size": 1 if mode == "single" else world}
            add_row(results, row, processor, mode, run_row(model, inputs, processor, mode, meshes.get(mode), args))
            print_row(results.rows[-1])
        if processor in results.single and len(args.modes) > 1:
            check_restored(model, inputs, processor, results, args)
    return results.rows


def check_restored(
    model: torch.nn.Module, inputs: dict, processor: str, results: Results, args: argparse.Namespace
) -> None:
    """One more single forward after the parallel modes: its max abs from the first single forward."""
    again = run_row(
        model, inputs, processor, "single", None, argparse.Namespace(**{**vars(args), "warmup": 0, "reps": 1})
    )
    row = next(r for r in results.rows if r["processor"] == processor and r["mode"] == "single")
    row["restored_max_abs"] = again.get("error") or max_abs(again["out"], results.single[processor])


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: dict) -> None:
    if dist.get_rank() != 0:
        return
    head = f"{row['model']:>9} {row['case']:>9} {row['tokens']:>6} {row['processor']:>12} {row['mode']:>8}"
    if "error" in row:
        print(f"{head}  error: {row['error']}", flush=True)
        return
    print(
        f"{head} {row['ms']:9.1f} {fmt(row['speedup_vs_single'], '8.2f')} {fmt(row['x_stock_same_mode'], '8.2f')} "
        f"{fmt(row['rel_l2_vs_single_same_processor'], '9.2e')} {fmt(row['max_abs_vs_single_same_processor'], '9.2e')} "
        f"{fmt(row['rel_l2_vs_single_stock'], '9.2e')} {fmt(row['peak_gib'], '7.1f')}",
        flush=True,
    )


def run_environment(device: torch.device) -> dict:
    env = {"diffusers": diffusers.__version__, "distributed_backend": dist.get_backend()}
    if device.type != "cuda":
        return {**env, "device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads()}
    return {**environment(), **env, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="klein-9B,dev", help=f"comma list of {list(MODELS)}")
    parser.add_argument("--cases", default="2048,1024+ref", help="comma list of '<side>' or '<side>+ref'")
    parser.add_argument("--processors", default="stock,pictor_bf16", help=f"comma list of {list(PROCESSORS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--text-tokens", type=int, default=TEXT_TOKENS)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="process group timeout")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.models, args.cases = args.models.split(","), [parse_case(c) for c in args.cases.split(",")]
    unknown = [m for m in args.models if m not in MODELS]
    for option, known in (("processors", PROCESSORS), ("modes", MODES)):
        picked = getattr(args, option).split(",")
        unknown += [p for p in picked if p not in known]
        setattr(args, option, [k for k in known if k in picked])  # stock first, single first: the references
    if unknown:
        raise SystemExit(f"unknown models, processors or modes: {unknown}")
    return args


def save(path: Path | None, record: dict) -> None:
    """Rank 0 writes `record` (after every case, so that a run cut short keeps what it measured)."""
    if path is None or dist.get_rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


@torch.no_grad()
def main() -> None:
    args = parse_args()
    device = init_distributed(args.device, args.timeout_s)
    diffusers.utils.logging.set_verbosity_error()  # enable_parallelism warns "experimental" on every call
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\.")  # its deprecated funcol calls
    world = dist.get_world_size()
    record = {"suite": "context_parallel", "environment": run_environment(device), "world_size": world}
    record |= {"models": {}, "rows": []}
    meshes = make_meshes(device, world)
    if dist.get_rank() == 0:
        print(HEADER, flush=True)
    for name in args.models:
        model, broadcast = build_model(name, device)
        parameters = sum(p.numel() for p in model.parameters())
        record["models"][name] = {"parameters": parameters, "weights_broadcast": broadcast}
        for case in args.cases:
            record["rows"] += bench_case(model, name, case, meshes, args)
            save(args.json, record)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

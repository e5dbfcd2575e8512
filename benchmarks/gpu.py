"""GPU benchmark: paper-size FPRM training throughput and model FLOP utilisation (CUDA only).

    python benchmarks/gpu.py [--batch 768] [--steps 20] [--loops 6] [--no-compile] [--peak-tflops 989]

FPRM as in the paper (arXiv 2606.18206; ``loopformer.models.fprm.paper_config``): d 512, 8 heads,
2 pre-norm blocks, SwiGLU x4, RoPE, 2-D depthwise conv on the 9x9 grid, Sudoku length 81, about 6.4M
parameters, global batch 768. One training step = one deep-supervision segment: K = 6 damped
iterations all with gradient (truncated BPTT), stablemax-free plain CE on the readout, backward,
AdamW step. Run with bf16 autocast, SDPA restricted to the flash kernel, and ``torch.compile`` of
the looped body (``model.step``, as the trainer compiles it).
Reports tokens/s (batch x 81 / step time), FLOPs per step (``FlopCounterMode`` on one eager step)
and MFU = achieved FLOP/s / peak (H200 bf16 dense: 989 TFLOP/s). Writes one JSON object to stdout
and to ``--out`` (default benchmarks/gpu.json). Exits with status 2 and a one-line message when
CUDA is not available. Self-contained (imports only loopformer), so it runs as a script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

H200_BF16_DENSE_TFLOPS = 989.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=768)
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--loops", type=int, default=6, help="iterations per segment (K)")
    p.add_argument("--grad-steps", type=int, default=6, help="differentiable final iterations")
    p.add_argument("--no-compile", action="store_true", help="eager mode")
    p.add_argument(
        "--sdpa", choices=("flash", "auto"), default="flash", help="restrict SDPA to the flash kernel"
    )
    p.add_argument(
        "--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="bf16 dense peak of the GPU"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().with_name("gpu.json"))
    return p.parse_args(argv)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); run the CPU benchmarks with `python -m benchmarks` instead.",
            file=sys.stderr,
        )
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    require_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from loopformer.loop import LoopConfig
    from loopformer.models.fprm import FPRM, paper_config
    from loopformer.nn import trunc_normal_state

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = FPRM(paper_config()).to(device)
    params = model.num_parameters()
    loop = LoopConfig(
        solver="damped",
        damp_gamma=0.9,
        damp_patience=5,
        halting="fixed",
        max_steps=args.loops,
        residual_norm="rel_sup",
        grad="truncated",
        grad_steps=args.grad_steps,
        trace=False,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=1e-3, fused=True)
    g = torch.Generator(device=device).manual_seed(0)
    seq = model.config.seq_len
    inputs = torch.randint(0, 11, (args.batch, seq), device=device, generator=g)
    labels = torch.randint(1, 11, (args.batch, seq), device=device, generator=g)
    z0 = trunc_normal_state((args.batch, seq, model.config.d_model), 6.0, device=device, generator=g)

    def kernel_ctx():
        if args.sdpa == "flash":
            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        return contextlib.nullcontext()

    def train_step() -> torch.Tensor:
        with kernel_ctx(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(inputs, loop=loop, state=z0)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    with FlopCounterMode(display=False) as counter:  # eager: the counter sees every matmul / attention
        train_step()
    flops = int(counter.get_total_flops())

    compile_error = None
    if not args.no_compile:
        try:
            model.step = torch.compile(model.step)  # type: ignore[method-assign]
        except Exception as err:
            compile_error = f"{type(err).__name__}: {err}"
    start = time.perf_counter()
    for _ in range(args.warmup):
        train_step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    achieved = flops / step_s
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "parameters": params,
        "batch": args.batch,
        "seq_len": seq,
        "loops": args.loops,
        "grad_steps": args.grad_steps,
        "compiled": not args.no_compile and compile_error is None,
        "compile_error": compile_error,
        "sdpa": args.sdpa,
        "warmup_s": round(warmup_s, 2),
        "step_ms_median": round(1000 * step_s, 3),
        "step_ms_min": round(1000 * min(times), 3),
        "tokens_per_s": round(args.batch * seq / step_s, 1),
        "flops_per_step": flops,
        "achieved_tflops": round(achieved / 1e12, 2),
        "peak_tflops": args.peak_tflops,
        "mfu": round(achieved / (args.peak_tflops * 1e12), 4),
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "final_loss": float(loss),
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()

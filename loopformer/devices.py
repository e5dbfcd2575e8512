"""Where evaluation runs: ``--device auto|cpu|cuda|cuda:N`` of ``loopformer eval``, ``solve`` and ``run``,
and the ``device=`` argument of ``loopformer.load``; the CPU thread count of a training or an evaluation
(``set_cpu_threads``: ``train.threads``, 0 = auto: one thread for a model below 2M parameters, else one per
physical core); and ``HostReads``, which counts the places where the host waits for the device's values.

``auto`` is CUDA when torch sees a GPU, else the CPU (what training does).  ``cuda:N`` must name a GPU
torch can see.  Precision follows the run: a run trained with ``bf16`` (``auto``: on CUDA; ``true``: on
every device, the CPU included) is evaluated under the same bf16 autocast (``loopformer.nn.autocast``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the commands read DEVICE_HELP before any torch work
    import torch

DEVICE_HELP = "auto (CUDA when present, else CPU), cpu, cuda or cuda:N"
# train.threads: 0 (auto) gives models below SMALL_MODEL_PARAMETERS one CPU thread: at the CPU recipes' sizes
# (the default job: 0.11M parameters) a second thread made a training step 54x slower on the loaded 2-core
# development machine (1.3 s vs 69 s per step, load average ~14; benchmarks/bench_threads.py,
# docs/performance.md); with tensors this small there is little for a second thread to gain even when idle
SMALL_MODEL_PARAMETERS = 2_000_000  # below this, one CPU thread (a second one only adds overhead)


def physical_cores() -> int:
    """Physical CPU cores available to this process (from /proc/cpuinfo; else os.cpu_count())."""
    try:
        pairs, phys = set(), None
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    pairs.add((phys, line.split(":")[1].strip()))
        if pairs:
            return max(1, min(len(pairs), len(os.sched_getaffinity(0))))
    except (OSError, AttributeError):
        pass
    return max(1, os.cpu_count() or 1)


def cpu_threads(threads: int, local_world_size: int, parameters: int) -> tuple[int, str]:
    """(CPU threads, why): ``threads`` (``train.threads``) when set, else 1 for a model below
    ``SMALL_MODEL_PARAMETERS``, else one per physical core (shared among ``local_world_size`` local ranks)."""
    if threads:
        return threads, "train.threads"
    if parameters < SMALL_MODEL_PARAMETERS:
        return 1, f"auto: a model below {SMALL_MODEL_PARAMETERS / 1e6:g}M parameters"
    return max(1, physical_cores() // local_world_size), "auto: one per physical core"


def set_cpu_threads(threads: int, device: torch.device, model: torch.nn.Module, dist: Any = None) -> int:
    """Set (on the CPU) and log the thread count ``cpu_threads`` chooses for ``model``; returns it. ``dist``:
    the process's place in a distributed job (``local_world_size``, ``is_main``: only the main rank logs);
    None for one process."""
    import torch

    if device.type != "cpu":
        return torch.get_num_threads()
    parameters = sum(p.numel() for p in model.parameters())
    count, why = cpu_threads(threads, getattr(dist, "local_world_size", 1), parameters)
    torch.set_num_threads(count)
    if getattr(dist, "is_main", True):
        logging.getLogger("loopformer.train").info("CPU threads: %d (%s; change with train.threads=N)", count, why)
    return count


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``auto`` / None -> CUDA when available, else CPU; ``cpu``; ``cuda``; ``cuda:N`` (checked)."""
    import torch

    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N (a string or torch.device)")
    text = (spec or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index = text.partition(":")[2]
        if index and not index.isdigit():
            raise ValueError(f"device {spec!r}: expected cuda:N with N a GPU index")
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {spec!r}: CUDA is not available here (torch {torch.__version__}); use cpu or auto"
            )
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} GPU(s) visible")
        return torch.device(text)
    raise ValueError(f"device {spec!r}: expected {DEVICE_HELP}")


# aten ops whose result the host needs before it can go on (a GPU would be synchronised): a scalar read, and
# the ops whose output shape depends on the values (the host must learn the shape)
HOST_READ_OPS = frozenset(
    {
        "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "masked_select",
        "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave",
        "bincount", "histc", "_assert_scalar",
    }
)  # fmt: skip
# Tensor methods that copy values to the host outside aten (on a CPU tensor they dispatch nothing)
HOST_READ_METHODS = frozenset({"tolist", "numpy", "cpu"})


@functools.cache
def _counting_modes() -> tuple[type, type]:
    """The two torch modes ``HostReads`` enters: aten ops (dispatch) and Tensor methods (torch function)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self, counts: Counter) -> None:
            super().__init__()
            self.counts = counts

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if name in HOST_READ_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    class Methods(TorchFunctionMode):
        def __init__(self, counts: Counter) -> None:
            super().__init__()
            self.counts = counts

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            if name in HOST_READ_METHODS:
                self.counts[f"Tensor.{name}"] += 1
            return func(*args, **(kwargs or {}))

    return Ops, Methods


class HostReads:
    """Count host reads inside a ``with`` block: the aten ops of ``HOST_READ_OPS`` (``float(t)``, ``int(t)``,
    ``bool(t)`` and ``.item()`` are ``_local_scalar_dense``; ``nonzero`` and boolean indexing need the count on
    the host) and the Tensor methods ``tolist`` / ``numpy`` / ``cpu``. On a GPU each of them stalls the CPU
    until the device has caught up, so the CPU cannot queue the next kernels. Counted on any device (on the
    CPU nothing stalls, but the same code on a GPU would): ``counts`` by name, ``total``. A ``.cpu()`` of a
    tensor that is already on the host counts too (the counter cannot know where it would live on a GPU)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._modes = tuple(mode(self.counts) for mode in _counting_modes())

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

"""The compiled one-pass host update (``host_adam.c``), built with the system C compiler on first use.

torch's fused CPU Adam reads and writes the state once, but the unscale before it and the cast after it are
passes of their own; tiling them through cache (``kernels.tiled_host_update``) saves traffic but pays three
kernel launches, and their barriers, per tile. ``host_adam.c`` does all three per element, in one loop, with
torch's own formula (see the file's header), and splits the sub-group over threads once per call.

The build takes about a second: ``cc -O3 -march=native -fopenmp`` on one C file, no torch headers. It is
loaded with ctypes after torch, so its OpenMP runtime is torch's and the sub-group is split over torch's
threads, and it is called as the torch op ``lightning_dos::host_adam``, so dispatch modes see its reads and
writes. The library is cached under ``~/.cache/lightning_dos/native`` (``$XDG_CACHE_HOME`` is honoured),
keyed by the source, the compiler and this CPU's flags, so a machine never loads a library built for another
CPU. Where there is no compiler, or the build fails, the engine uses torch's kernels (same formula; slower)
and warns once. ``LIGHTNING_DOS_NATIVE=0`` turns the compiled kernel off without a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_dos.engine.update_rules import Hyper

SOURCE = Path(__file__).with_name("host_adam.c")
#: Set to 0 to use torch's kernels on the host (the pure-torch path; no compiler needed).
ENV_SWITCH = "LIGHTNING_DOS_NATIVE"
#: -ffp-contract=off: the compiler must not fuse multiplies and adds the file keeps apart (see host_adam.c).
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
#: Fewer elements per thread than this and a thread's hand-off costs more than its share saves. Measured
#: (2 threads, cache-resident, bench/RESULTS.md): 2 threads beat 1 from 16K elements up (28 vs 33 us).
MIN_ELEMENTS_PER_THREAD = 1 << 14
_LP_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}

_lock = threading.Lock()
_kernel: HostAdamKernel | None = None
_failure: str | None = None
_loaded = False
_warned = False


def enabled() -> bool:
    """False when ``LIGHTNING_DOS_NATIVE=0`` asks for torch's kernels."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _compiler() -> str | None:
    named = os.environ.get("CC")
    if named:
        return shutil.which(named) or None
    return next((path for path in map(shutil.which, ("cc", "gcc", "clang")) if path), None)


def _cpu_flags() -> str:
    """This CPU's feature flags: a library built with -march=native for one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where built libraries are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_dos" / "native"


def compile_library(compiler: str, flags: list[str], target: Path) -> None:
    """Compile ``host_adam.c`` into the shared library ``target`` with ``compiler`` and ``flags`` (added to
    :data:`FLAGS`). The library appears whole or not at all, so processes building at once each install a whole
    one.

    Raises:
        RuntimeError: the compiler failed; the message has the command and the end of its output.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    command = [compiler, *FLAGS, *flags, "-o", str(partial), str(SOURCE)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-400:]}")
    os.replace(partial, target)


def build() -> Path:
    """Build ``host_adam.c`` for this CPU (or find it built) and return the library's path.

    Tries ``-march=native`` (this CPU's widest vectors) and ``-fopenmp`` (torch's thread pool; see
    host_adam.c) first, then without each, as some compilers refuse them.

    Raises:
        RuntimeError: no C compiler was found, or it could not build the file (the message has its output).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), _cpu_flags()]).encode())
    target = cache_dir() / f"host_adam-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    errors = []
    for flags in (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], []):
        try:
            compile_library(compiler, flags, target)
            return target
        except RuntimeError as error:
            errors.append(str(error))
    raise RuntimeError("the C compiler could not build host_adam.c:\n" + "\n".join(errors))


class HostAdamKernel:
    """A loaded build of ``host_adam.c``, called like :func:`host_adam` (without its first check)."""

    def __init__(self, path: Path) -> None:
        """Load the library at ``path`` (built by :func:`build` or :func:`compile_library`)."""
        self.path = path
        self._fn = ctypes.CDLL(str(path)).dos_host_adam
        self._fn.restype = ctypes.c_int
        f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p
        self._fn.argtypes = [p, p, p, p, p, i, ctypes.c_int64, f, i, f, f, i, f, f, f, f, f, f, i]

    def __call__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: float,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        decoupled: bool,
        inv_grad_scale: float = 1.0,
        lp_out: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> None:
        numel = param.numel()
        for t in (param, grad, exp_avg, exp_avg_sq):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel:
                raise ValueError("host_adam needs contiguous fp32 CPU tensors of one size")
        if lp_out is not None and (
            lp_out.dtype not in _LP_KINDS
            or lp_out.device.type != "cpu"
            or not lp_out.is_contiguous()
            or lp_out.numel() != numel
        ):
            raise ValueError("lp_out must be a contiguous bf16, fp16 or fp32 CPU tensor with as many elements as param")
        constants = step_constants(step, lr, beta1, beta2, eps, weight_decay, decoupled, inv_grad_scale)
        threads = threads or torch.get_num_threads()
        threads = max(1, min(threads, math.ceil(numel / MIN_ELEMENTS_PER_THREAD)))
        self._fn(
            param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
            None if lp_out is None else lp_out.data_ptr(), _LP_KINDS[None if lp_out is None else lp_out.dtype],
            numel, *constants, threads,
        )  # fmt: skip


def step_constants(
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    inv_grad_scale: float = 1.0,
) -> tuple[float | int, ...]:
    """The scalar arguments of ``dos_host_adam`` between ``numel`` and ``threads`` (``inv_scale`` to
    ``neg_step_size``), derived as torch's kernel derives them: in double, rounded to float where used. The
    arguments are those of :func:`host_adam`."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    lerp_weight = 1 - beta1
    lerp_small = abs(ctypes.c_float(lerp_weight).value) < 0.5
    lerp_coeff = ctypes.c_float(lerp_weight).value - (0.0 if lerp_small else 1.0)
    decays = weight_decay != 0.0
    return (
        inv_grad_scale,
        # Without decay, either mode multiplies the weights by exactly 1.0: a no-op, as torch skips the decay.
        int(decoupled or not decays), 1 - lr * weight_decay if decays else 1.0, weight_decay,
        int(lerp_small), lerp_coeff, beta2, 1 - beta2, math.sqrt(bias_correction2), eps, -(lr / bias_correction1),
    )  # fmt: skip


def _load() -> HostAdamKernel | None:
    global _kernel, _failure, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _kernel = HostAdamKernel(build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _failure = str(error)
        return _kernel


def available() -> bool:
    """True when the compiled kernel is enabled and loads (building it the first time)."""
    return enabled() and _load() is not None


def unavailable_reason() -> str | None:
    """Why the compiled kernel is not in use, or None when it is."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    _load()
    return _failure


def warn_if_unavailable() -> None:
    """Warn once per process when the compiled kernel could not be built (not when it was switched off)."""
    global _warned
    if _warned or not enabled() or _load() is not None:
        return
    _warned = True
    warnings.warn(
        f"lightning-dos: the compiled host Adam kernel is unavailable ({_failure.splitlines()[0]}); host updates "
        f"use torch's kernels, which are slower. Install a C compiler (gcc or clang, or name one in $CC), or set "
        f"{ENV_SWITCH}=0 to use torch's kernels without this warning.",
        stacklevel=2,
    )


def host_adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    inv_grad_scale: float = 1.0,
    lp_out: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """One Adam step over contiguous fp32 CPU tensors, with the unscale and the cast in the same pass.

    Computes, for every element, what torch's fused CPU Adam computes on its vector path (see host_adam.c), from
    the gradient multiplied by ``inv_grad_scale`` (the gradient itself is left as it came); the fresh weights are
    also written to ``lp_out`` in its dtype. The caller checks :func:`available` first.

    Args:
        param: fp32 master weights, updated in place.
        grad: fp32 gradient, read only.
        exp_avg: first moment, updated in place.
        exp_avg_sq: second moment, updated in place.
        step: the step number being applied (1 for the first), for bias correction.
        lr: learning rate.
        beta1: first-moment decay.
        beta2: second-moment decay.
        eps: term added to the denominator.
        weight_decay: weight-decay coefficient.
        decoupled: True for AdamW's decoupled decay, False for Adam's L2 penalty.
        inv_grad_scale: what the gradient is multiplied by (1 / DeepSpeed's combined scale); 1.0 for none.
        lp_out: contiguous bf16, fp16 or fp32 CPU tensor of as many elements, or None for no copy.
        threads: threads to split the elements over (default: torch's intra-op count; fewer for small
            tensors, :data:`MIN_ELEMENTS_PER_THREAD` each at least).

    Raises:
        RuntimeError: the compiled kernel is unavailable (see :func:`unavailable_reason`).
        ValueError: a tensor is not what the kernel takes; nothing has been changed.
    """
    if _load() is None:
        raise RuntimeError(f"the compiled host Adam kernel is unavailable: {_failure}")
    # Through torch's dispatcher, so that torch's dispatch modes (the stream-race checker in lightning_dos.sim)
    # see which tensors the kernel reads and writes, as they see torch's own kernels.
    torch.ops.lightning_dos.host_adam(
        param, grad, exp_avg, exp_avg_sq, float(step), lr, beta1, beta2, eps, weight_decay, decoupled,
        inv_grad_scale, lp_out, threads or 0,
    )  # fmt: skip


def supports(rule: str, master_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """Whether the compiled kernel runs ``rule`` with master weights (and gradients) in ``master_dtype`` and
    states in ``state_dtype``."""
    return rule == "adam" and master_dtype == torch.float32 and state_dtype == torch.float32


def host_update(
    rule: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: Sequence[torch.Tensor],
    step: float,
    hyper: Hyper,
    inv_grad_scale: float = 1.0,
    lp_out: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """One step of ``rule`` (an ``UpdateRule`` name) over contiguous CPU tensors, unscale and cast in the same
    pass; states in the rule's order. Arguments otherwise as for :func:`host_adam`."""
    if not supports(rule, param.dtype, states[0].dtype if states else param.dtype):
        raise ValueError(f"the compiled host kernel does not run {rule} in {param.dtype}")
    h = hyper
    host_adam(param, grad, *states, step, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled,
              inv_grad_scale, lp_out, threads)  # fmt: skip


def _host_adam_op(*args: object) -> None:
    _load()(*args)  # host_adam checked that it loads


#: The op's schema, in the order of :func:`host_adam`'s arguments: (a!) marks what the kernel writes; the
#: gradient is read only.
OP_SCHEMA = (
    "host_adam(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float step, float lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool decoupled, float inv_grad_scale, "
    "Tensor(d!)? lp_out, int threads) -> ()"
)
_ops = torch.library.Library("lightning_dos", "FRAGMENT")  # kept: the registration lasts as long as this object
_ops.define(OP_SCHEMA)
_ops.impl("host_adam", _host_adam_op, "CPU")

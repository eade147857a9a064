"""The compiled one-pass host update (``host_adam.c``), built with the system C compiler on first use.

torch's fused CPU Adam reads and writes the state once, but the unscale before it and the cast after it are
passes of their own; tiling them through cache (``kernels.tiled_update``) saves traffic but pays three
kernel launches, and their barriers, per tile. ``host_adam.c`` does all three per element, in one loop, with
torch's own formula (Lion: DeepSpeed's ``DeepSpeedCPULion``'s; see the file's header), and splits the sub-group
over threads once per call.

The build takes a few seconds (60 loops: each rule, storage and loop-invariant choice, and Lion's two formulas):
``cc -O3 -march=native -fopenmp`` on one C file, no torch headers. It is loaded with ctypes after torch, so its
OpenMP runtime is torch's and the sub-group is split over torch's threads, and it is called as the torch op
``lightning_dos::host_update`` (every rule and storage: :func:`host_update`), so dispatch modes see its reads and
writes. The library is cached under
``~/.cache/lightning_dos/native`` (``$XDG_CACHE_HOME`` is honoured), keyed by the source, the compiler and this
CPU's flags, so a machine never loads a library built for another CPU. It takes no lock: each build compiles into
a file of its own and renames it into place whole, so a build killed mid-way stops no later one (which builds it
again) and leaves only its partial file (removed an hour later). Where there is no compiler, or the build
fails, the engine uses torch's kernels (the same formulas, slower; Lion's rounds as DeepSpeed's does only where it
fuses nothing: see ``update_rules``) and warns once. ``LIGHTNING_DOS_NATIVE=0`` turns the compiled kernel off
without a warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_dos.engine.announce import about, announce_build
from lightning_dos.model.update_rules import RULES, Hyper

SOURCE = Path(__file__).with_name("host_adam.c")
#: Set to 0 to use torch's kernels on the host (the pure-torch path; no compiler needed).
ENV_SWITCH = "LIGHTNING_DOS_NATIVE"
#: -ffp-contract=off: the compiler must not fuse multiplies and adds the file keeps apart (see host_adam.c).
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
#: Fewer elements per thread than this and a thread's hand-off costs more than its share saves. Measured
#: (2 threads, cache-resident, bench/RESULTS.md): 2 threads beat 1 from 16K elements up (28 vs 33 us).
MIN_ELEMENTS_PER_THREAD = 1 << 14
_LP_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
#: host_adam.c's RULE_* and DTYPES_* (master weights and gradient, states).
_RULE_IDS = {"adam": 0, "adagrad": 1, "lion": 2}
_DTYPES = {
    (torch.float32, torch.float32): 0,
    (torch.bfloat16, torch.float32): 1,
    (torch.bfloat16, torch.bfloat16): 2,
}

#: The kernel's build, one compiler job: 27 s on a busy 2-core machine (tests/test_native_kernel.py), seconds on most.
BUILD_TIME = about((5, 40))
#: A partial library this much older than the compiler's time limit (300 s) is one a killed build left.
PARTIAL_LEFT_S = 3600.0
_lock = threading.Lock()
_kernel: HostUpdateKernel | None = None
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


def remove_partials_left(folder: Path) -> None:
    """Remove the partial libraries that builds killed mid-way left in ``folder`` (no lock is taken: a killed build
    leaves only its ``.tmp``, which stops nothing, and is removed once :data:`PARTIAL_LEFT_S` old, whoever made
    it: no build, on this host or one sharing the folder, still writes it)."""
    for partial in folder.glob("host_adam-*.so.*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - partial.stat().st_mtime > PARTIAL_LEFT_S:
                partial.unlink()


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
    remove_partials_left(target.parent)
    announce_build("the host update kernel (host_adam.c)", "for the engine", "once per compiler and CPU", BUILD_TIME)
    errors = []
    for flags in (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], []):
        try:
            compile_library(compiler, flags, target)
            return target
        except RuntimeError as error:
            errors.append(str(error))
    raise RuntimeError("the C compiler could not build host_adam.c:\n" + "\n".join(errors))


class Step(ctypes.Structure):
    """``Step`` of host_adam.c: one step's scalars, each rule reading its own (see the C struct's comments)."""

    _fields_ = [
        ("decoupled", ctypes.c_int),
        ("decay_factor", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("lerp_small", ctypes.c_int),
        ("lerp_coeff", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("sq_coeff", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
        ("torch_width", ctypes.c_int),
    ]


@functools.cache
def torch_float_width() -> int:
    """The float vector width of the fused Adam torch runs here (16 under its AVX-512 kernels, 8 under AVX2): the
    last elements of each call take torch's scalar remainder, which rounds the second moment its own way
    (host_adam.c, ``adam_scalar_from``). 0 under torch's generic kernels, which the engine does not reproduce. Read
    once: torch picks its kernels once per process."""
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


def supports(rule: str, master_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """Whether the compiled kernel has a loop for ``rule`` (an :attr:`UpdateRule.name`) with master weights and
    gradient of ``master_dtype`` and states of ``state_dtype``: fp32 throughout, bf16 master weights with fp32
    states, or all bf16 (DeepSpeed keeps bf16 states only beside bf16 master weights). Whether the kernel is built
    here is :func:`available`'s question."""
    return rule in _RULE_IDS and (master_dtype, state_dtype) in _DTYPES


def step_scalars(rule: str, step: float, hyper: Hyper) -> Step:
    """The :class:`Step` of ``rule`` for step number ``step`` (1 for the first) and ``hyper``. Adam and Adagrad:
    derived in double as torch's formula (:meth:`UpdateRule.torch_update`) derives them, rounded to float where used;
    Lion: the hyperparameters rounded to float, as DeepSpeed's ``DeepSpeedCPULion`` takes them (the kernel derives
    the rest in float, as DeepSpeed's does)."""
    h = hyper
    if rule == "adam":
        return _adam_step(step, h)
    if rule == "adagrad":  # torch's Adagrad: decay when weight_decay != 0; clr from the step as a Python float
        clr = h.lr / (1 + (step - 1) * h.lr_decay)
        return Step(int(h.weight_decay != 0), 1.0, h.weight_decay, 0, 0.0, 0.0, 0.0, 0.0, 1.0, h.eps, -clr)
    if rule == "lion":  # DeepSpeedCPULion's own float arguments (it decays only for weight_decay > 0); host_adam.c
        # derives 1 - beta1, 1 - beta2 and 1 - lr * weight_decay from them in float, as DeepSpeed's kernel does
        return Step(int(h.weight_decay > 0), 0.0, h.weight_decay, 0, 0.0, h.beta1, h.beta2, 0.0, 1.0, 0.0, h.lr)
    raise ValueError(f"unknown update rule {rule!r}; the compiled kernel runs {', '.join(_RULE_IDS)}")


def _check(rule: str, param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
           lp_out: torch.Tensor | None,
           out: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None) -> None:  # fmt: skip
    """Raise ValueError naming what is wrong with the arguments of :func:`host_update`."""
    if rule not in _RULE_IDS:
        raise ValueError(f"unknown update rule {rule!r}; the compiled kernel runs {', '.join(_RULE_IDS)}")
    expected = RULES[rule].states
    if len(states) != len(expected):
        raise ValueError(f"{rule} takes {len(expected)} state tensor(s) ({', '.join(expected)}), got {len(states)}")
    numel = param.numel()
    for name, t in (("param", param), ("grad", grad), *zip(expected, states)):
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel:
            raise ValueError(f"host_update({rule}): {name} must be a contiguous CPU tensor of {numel} elements")
    if grad.dtype != param.dtype:
        raise ValueError(f"host_update({rule}): grad is {grad.dtype}, param {param.dtype}: they must be one dtype")
    state_dtypes = {t.dtype for t in states}
    if len(state_dtypes) > 1:
        raise ValueError(f"host_update({rule}): the states must be one dtype, got {sorted(map(str, state_dtypes))}")
    if not supports(rule, param.dtype, states[0].dtype):
        raise ValueError(
            f"host_update({rule}): master weights {param.dtype} with states {states[0].dtype} are not supported; "
            "the kernel runs fp32 master with fp32 states, bf16 master with fp32 states, or bf16 with bf16"
        )
    if lp_out is not None and (
        lp_out.dtype not in _LP_KINDS
        or lp_out.device.type != "cpu"
        or not lp_out.is_contiguous()
        or lp_out.numel() != numel
    ):
        raise ValueError("lp_out must be a contiguous bf16, fp16 or fp32 CPU tensor with as many elements as param")
    if out is None:
        return
    out_param, out_states = out
    if len(out_states) != len(states):
        raise ValueError(f"host_update({rule}): out holds {len(out_states)} state tensor(s), the rule {len(states)}")
    for name, t, like in (("out param", out_param, param), *zip(expected, out_states, states)):
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel or t.dtype != like.dtype:
            raise ValueError(f"host_update({rule}): out's {name} must be a contiguous CPU {like.dtype} of {numel}")


class HostUpdateKernel:
    """A loaded build of ``host_adam.c``: :meth:`update` is :func:`host_update` (without the check that the kernel
    loads)."""

    def __init__(self, path: Path) -> None:
        """Load the library at ``path`` (built by :func:`build` or :func:`compile_library`)."""
        self.path = path
        library = ctypes.CDLL(str(path))
        self._fn = library.dos_host_update
        self._fn.restype = ctypes.c_int
        i, p = ctypes.c_int, ctypes.c_void_p
        self._fn.argtypes = [i, i, p, p, p, p, p, p, p, p, i, ctypes.c_int64, ctypes.c_float, ctypes.POINTER(Step), i]
        self._lion_width, self._lion_fused = library.dos_lion_vector_width, library.dos_lion_fused
        self._lion_width.argtypes, self._lion_width.restype, self._lion_fused.restype = [i], i, i

    def lion_form(self, master_dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[int, bool]:
        """How this build runs Lion, as DeepSpeed's ``DeepSpeedCPULion`` built for the same CPU runs it (see
        host_adam.c): the width of DeepSpeed's vector body for these dtypes (0: its scalar loop runs every element;
        otherwise the last ``numel % width`` of a call), and whether its scalar loop and its decay factor are
        fused multiply-adds (True where the CPU has FMA) or rounded product by product."""
        return self._lion_width(_DTYPES[master_dtype, state_dtype]), bool(self._lion_fused())

    def update(
        self,
        rule: str,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: Sequence[torch.Tensor],
        step: float,
        hyper: Hyper,
        inv_grad_scale: float = 1.0,
        lp_out: torch.Tensor | None = None,
        threads: int | None = None,
        out: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """:func:`host_update` on this build."""
        _check(rule, param, grad, states, lp_out, out)
        scalars = step_scalars(rule, step, hyper)
        numel = param.numel()
        threads = threads or torch.get_num_threads()
        threads = max(1, min(threads, math.ceil(numel / MIN_ELEMENTS_PER_THREAD)))
        second = states[1].data_ptr() if len(states) > 1 else None
        targets = [None, None, None]
        if out is not None:
            targets = [out[0].data_ptr(), out[1][0].data_ptr(), out[1][1].data_ptr() if len(states) > 1 else None]
        status = self._fn(
            _RULE_IDS[rule], _DTYPES[param.dtype, states[0].dtype], param.data_ptr(), grad.data_ptr(),
            states[0].data_ptr(), second, *targets, None if lp_out is None else lp_out.data_ptr(),
            _LP_KINDS[None if lp_out is None else lp_out.dtype], numel, inv_grad_scale, ctypes.byref(scalars), threads,
        )  # fmt: skip
        if status == -2:  # the checks above make this unreachable; a library out of step with this file is not
            raise RuntimeError(f"{self.path} refused rule {rule!r} or its dtypes: rebuild it")


def _adam_step(step: float, hyper: Hyper) -> Step:
    """Adam's :class:`Step` (its loop reads the fields from ``decoupled`` to ``neg_step_size`` and the vector width)
    for step number ``step``, derived as torch's kernel derives them: in double, rounded to float where used."""
    lr, beta1, beta2, weight_decay = hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    lerp_weight = 1 - beta1
    lerp_small = abs(ctypes.c_float(lerp_weight).value) < 0.5
    lerp_coeff = ctypes.c_float(lerp_weight).value - (0.0 if lerp_small else 1.0)
    decays = weight_decay != 0.0
    return Step(
        # Without decay, either mode multiplies the weights by exactly 1.0: a no-op, as torch skips the decay.
        int(hyper.decoupled or not decays), 1 - lr * weight_decay if decays else 1.0, weight_decay,
        int(lerp_small), lerp_coeff, 0.0, beta2, 1 - beta2, math.sqrt(bias_correction2), hyper.eps,
        -(lr / bias_correction1), torch_float_width(),
    )  # fmt: skip


def _load() -> HostUpdateKernel | None:
    global _kernel, _failure, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _kernel = HostUpdateKernel(build())
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


def lion_form(master_dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[int, bool]:
    """:meth:`HostUpdateKernel.lion_form` of the engine's build.

    Raises:
        RuntimeError: the compiled kernel is unavailable (see :func:`unavailable_reason`).
    """
    if _load() is None:
        raise RuntimeError(f"the compiled host update kernel is unavailable: {_failure}")
    return _kernel.lion_form(master_dtype, state_dtype)


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
    out: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None,
) -> None:
    """One step of ``rule`` over contiguous CPU tensors, with the unscale and the cast in the same pass.

    Computes, for every element, what ``RULES[rule].torch_update`` computes on this CPU (bit for bit; Adam: on
    torch's vector body, see host_adam.c), or for Lion what DeepSpeed's ``DeepSpeedCPULion`` computes on these
    tensors on this CPU (bit for bit, its vector body and its scalar loop: :meth:`HostUpdateKernel.lion_form`), from
    the gradient multiplied by ``inv_grad_scale`` in fp32 (the gradient itself is left as it came). bf16 master
    weights, gradient or states are loaded into fp32, computed as fp32 ones are, and stored rounded to nearest
    even; the copy in ``lp_out`` is cast from the stored master weights (DeepSpeed copies its 16-bit partition from
    them). The caller checks :func:`available` (and :func:`supports`) first.

    Args:
        rule: the :attr:`UpdateRule.name` (``adam``, ``adagrad`` or ``lion``).
        param: master weights, fp32 or bf16, updated in place.
        grad: gradient of ``param``'s dtype, read only.
        states: the rule's state tensors in :attr:`UpdateRule.states` order, all fp32, or all bf16 with bf16
            ``param``; updated in place.
        step: the step number being applied (1 for the first): Adam's bias correction, Adagrad's lr decay.
        hyper: the param group's hyperparameters (each rule reads its own).
        inv_grad_scale: what the gradient is multiplied by (1 / DeepSpeed's combined scale); 1.0 for none.
        lp_out: contiguous bf16, fp16 or fp32 CPU tensor of as many elements, or None for no copy.
        threads: threads to split the elements over (default: torch's intra-op count; fewer for small
            tensors, :data:`MIN_ELEMENTS_PER_THREAD` each at least).
        out: ``(master weights, states)`` to write the step's result into instead of ``param`` and ``states``,
            which are then only read (the same dtypes and sizes); None updates in place.

    Raises:
        RuntimeError: the compiled kernel is unavailable (see :func:`unavailable_reason`).
        ValueError: an unknown rule, or a tensor the kernel does not take (see :func:`supports`); nothing has
            been changed.
    """
    if _load() is None:
        raise RuntimeError(f"the compiled host update kernel is unavailable: {_failure}")
    _check(rule, param, grad, states, lp_out, out)
    h = hyper
    out_param, out_states = (None, []) if out is None else (out[0], list(out[1]))
    torch.ops.lightning_dos.host_update(
        rule, param, grad, list(states), float(step), h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled,
        h.lr_decay, inv_grad_scale, lp_out, threads or 0, out_param, out_states,
    )  # fmt: skip


def _host_update_op(
    rule: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    lr_decay: float,
    inv_grad_scale: float,
    lp_out: torch.Tensor | None,
    threads: int,
    out_param: torch.Tensor | None,
    out_states: list[torch.Tensor],
) -> None:
    hyper = Hyper(lr, beta1, beta2, eps, weight_decay, decoupled, lr_decay)
    out = None if out_param is None else (out_param, out_states)
    _load().update(rule, param, grad, states, step, hyper, inv_grad_scale, lp_out, threads or None, out)


#: The op's schema, in the order of :func:`host_update`'s arguments (the hyperparameters spelled out): (a!) marks
#: what the kernel writes (every state tensor of the list); the gradient is read only. An out-of-place call
#: (``out_param`` given) writes the out tensors and only reads ``param`` and ``states``, which a schema cannot say
#: per call: they stay marked written, so a race checker sees more writes than happen, never fewer.
UPDATE_OP_SCHEMA = (
    "host_update(str rule, Tensor(a!) param, Tensor grad, Tensor(b!)[] states, float step, float lr, float beta1, "
    "float beta2, float eps, float weight_decay, bool decoupled, float lr_decay, float inv_grad_scale, "
    "Tensor(c!)? lp_out, int threads, Tensor(d!)? out_param, Tensor(e!)[] out_states) -> ()"
)
_ops = torch.library.Library("lightning_dos", "FRAGMENT")  # kept: the registration lasts as long as this object
_ops.define(UPDATE_OP_SCHEMA)
_ops.impl("host_update", _host_update_op, "CPU")

"""Native CPU kernels, written in this package's own C++ (``csrc/``) and built on this machine on first use.

Each op has a pure-torch twin (the reference its tests compare against, and the path that runs where the
kernels are off or cannot be built). Today:

* ``paged_decode_attention``: decode attention read in place from the paged KV cache, with gpt-oss's sinks
  and sliding windows (afd/models/paged_attention.py says when it is used);
* ``dsa_index_topk``: DeepSeek Sparse Attention's indexer at decode, its scores over the cached index keys
  read in place and each token's top-k (afd/models/sparse_attention.py);
* ``moe_experts``: the routed experts a process holds, the per-expert loop of
  ``GroupedExperts.forward`` (afd/models/layers.py) in one call: in plain C++ at decode sizes, the loop's own
  ATen ops (bit for bit) past them; with gpt-oss's biases and clamped SwiGLU, and its MXFP4 blocks decoded
  per expert;
* ``rms_norm``, ``rotary``: ``RMSNorm`` and ``RotaryEmbedding.apply`` (afd/models/layers.py) in one pass
  over each row, with their dtype rules;
* ``linear``: ``F.linear`` at decode sizes (a few rows), reading the weight once in place instead of
  packing it per call (``afd.models.layers.linear``: every ``Linear`` of the models, the router, the experts).
* ``int8_matmul``: a W8A8 linear's int8 GEMM at decode sizes (int32 accumulators), the int8 weight read once in
  place with AVX512-VNNI dot products; more rows, or a CPU without VNNI, go to ``torch._int_mm`` (afd/models/int8.py).
* ``gdn_decode``: Gated DeltaNet's recurrence at decode (Qwen3-Next, Qwen3.5), one token per sequence, its
  fp32 state read once and rewritten once in place in the state cache's slots, with no gathered copy
  (``recurrent_step`` and the gather and scatter around it in afd/models/gated_deltanet.py).

The build is torch's own extension builder (``torch.utils.cpp_extension.load``: the machine's C++ compiler
and ninja), keyed by a hash of the sources (their text and their place), the flags and the CPU's
features, under torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``):
the first process of a checkout on a machine pays ~40-60 s, concurrent processes wait for that one build,
later ones load the library in ~0.2 s. The kernels compute in register tiles for the widest vector set
the CPU has, AVX-512 or AVX2 (``csrc/simd.h``); ``ops().simd`` names it (``"none"``: plain loops).
``make setup`` builds it, so a server's first start does not. ``AFD_KERNELS=0`` turns the kernels off;
a build that fails is logged once as a warning and afd runs the pure-torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from afd import env

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("ops.cpp", "paged_decode.cpp", "moe_experts.cpp", "norm_rope.cpp", "small_linear.cpp",
                                                                        "gated_deltanet.cpp", "int8_linear.cpp", "amx.cpp",
                                                                        "mla_decode.cpp", "moe_experts_int8.cpp", "widened_linear.cpp", "dsa_index.cpp",
                                                                        "broadcast_linear.cpp", "moe_experts_transposed.cpp"))
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("simd.h", "small_linear.h", "int8_linear.h", "moe_experts.h"))
def cflags() -> tuple[str, ...]:
    """-march=native (``AFD_KERNELS_MARCH``): the library is built on the machine that runs it, for its CPU (or an
    older one's instructions, to measure what that CPU would run); OpenMP's simd pragmas vectorize the reductions
    without -ffast-math (the order of a dot product's sum changes, nothing else); -fopenmp makes at::parallel_for
    use torch's threads (without it the header-inlined loop runs on one)."""
    return ("-O3", f"-march={env.kernels_march()}", "-fopenmp")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux): a library built with -march=native on one CPU is never loaded on
    another (a home directory shared between machines would otherwise hand an AVX-512 build to an AVX2 CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _name() -> str:
    """The library's name: a hash of the sources (their text and their place), the flags (the -march among them) and
    the CPU."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    # the sources' directory too: torch's builder writes their absolute paths into the build, so two checkouts
    # sharing one name would rebuild over each other's library (a 40-70 s stall on every switch)
    digest.update(" ".join((*cflags(), platform.machine(), _cpu_flags(), str(SOURCES[0].parent.resolve()))).encode())
    return f"afd_kernels_{digest.hexdigest()[:12]}"


def build(name: str) -> None:
    """Build the library with torch's extension builder (``python -m afd.kernels --build NAME`` runs it, in a
    process of its own). torch runs ``ninja`` from PATH; the one afd depends on lives beside the venv's python,
    which is not on PATH when the venv is not activated: the builder's process gets it on its PATH, and no
    process that serves has its environment changed."""
    from torch.utils import cpp_extension

    cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(cflags()), extra_ldflags=["-fopenmp"],
                       verbose=False)


def _build_in_a_process(name: str) -> None:
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            path = os.pathsep.join((ninja.BIN_DIR, path))
        except ImportError:
            pass
    res = subprocess.run([sys.executable, "-m", "afd.kernels", "--build", name], capture_output=True, text=True,
                         env={**os.environ, "PATH": path})
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip() or res.stdout.strip() or f"the build exited {res.returncode}")


@functools.cache
def ops() -> ModuleType | None:
    """The compiled kernels, or None where they are off (``AFD_KERNELS=0``) or could not be built. A built
    library is loaded directly (no build tool runs); a missing one is built first, in a process of its own
    (concurrent builders wait for one build: torch's lock in the build directory)."""
    if not env.kernels_enabled():
        return None
    env.kernels_march()  # a bad value is the user's error to see, not a reason to run the torch paths
    try:
        from torch.utils import cpp_extension

        name = _name()
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))
        library = directory / f"{name}{cpp_extension.LIB_EXT}"
        if not library.exists() or (directory / "lock").exists():  # not built, or being built now
            log.debug("building afd's CPU kernels (%s; once per version and machine)", name)
            _build_in_a_process(name)
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as exc:  # no compiler, no ninja, a compile error: the pure-torch paths still serve
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        # the compiler's first complaint, if it was one, before any other line that names an error
        # (the compiler's "file:line: error:", the assembler's "file:line: Error:")
        errors = [line for line in lines if ": error:" in line.lower()] + [line for line in lines if "error" in line.lower()]
        log.warning("afd's CPU kernels could not be built, so the pure-torch paths run (slower decode attention and "
                    "experts): %s", errors[0] if errors else lines[-1])
        return None


def main() -> int:
    """``python -m afd.kernels``: build (or find) the kernels now, and say which (``make setup`` runs it).
    ``--build NAME``: the builder's own process (:func:`build`)."""
    if len(sys.argv) == 3 and sys.argv[1] == "--build":
        build(sys.argv[2])
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = ops()
    print(f"afd kernels: {built.__name__} ({built.simd} register tiles, int8: {built.int8_tiles}, bf16: {built.bf16_tiles}{', vdpbf16ps' if built.bf16_dot else ''}) "
          f"at {built.__file__}" if built is not None
          else "afd kernels: not built (see the warning above); the pure-torch paths will run")
    return 0

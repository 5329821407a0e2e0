"""Build the Cython extensions of quillcache._native.

Every ``src/quillcache/_native/*.pyx`` is one extension.  The io_uring paths (the WAL, the
SSD read ring) are compiled only when pkg-config finds liburing; the extensions still build
without it (then ``QC_HAVE_LIBURING`` is 0: the WAL uses pwritev + fdatasync and the SSD
tier reads through its thread pool).

Environment:
  QUILLCACHE_DEBUG=1        bounds checks, wraparound, line tracing, asserts, -O0 -g
  QUILLCACHE_EXTENSIONS=a,b build only these extensions (handy while one is broken)
  QUILLCACHE_NO_URING=1     build without liburing even when it is installed
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, find_packages, setup

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "src" / "quillcache" / "_native"
DEBUG = os.environ.get("QUILLCACHE_DEBUG", "") not in ("", "0")


def _pkg_config(*args):
    if shutil.which("pkg-config") is None:
        return None
    try:
        out = subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError:
        return None
    return out.stdout.split()


def _liburing():
    if os.environ.get("QUILLCACHE_NO_URING", "") not in ("", "0"):
        return None
    cflags = _pkg_config("--cflags", "liburing")
    libs = _pkg_config("--libs", "liburing")
    if cflags is None or libs is None:
        return None
    return cflags, libs


def extensions():
    wanted = {n.strip() for n in os.environ.get("QUILLCACHE_EXTENSIONS", "").split(",") if n.strip()}
    uring = _liburing()
    if DEBUG:
        cflags = ["-O0", "-g3", "-UNDEBUG"]
        macros = [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")]
    else:
        cflags = ["-O3", "-DNDEBUG"]
        macros = []
    cflags += ["-Wno-unused-function", "-Wno-unreachable-code"]
    exts = []
    for pyx in sorted(NATIVE.glob("*.pyx")):
        name = pyx.stem
        if wanted and name not in wanted:
            continue
        ext_macros = list(macros)
        ext_cflags = list(cflags)
        libraries = []
        if name in ("wal", "ioring"):
            if uring is not None:
                ext_macros.append(("QC_HAVE_LIBURING", "1"))
                ext_cflags += uring[0]
                libraries += [f[2:] for f in uring[1] if f.startswith("-l")]
            else:
                ext_macros.append(("QC_HAVE_LIBURING", "0"))
        exts.append(
            Extension(
                f"quillcache._native.{name}",
                [str(pyx.relative_to(HERE))],
                include_dirs=[str((NATIVE / "includes").relative_to(HERE))],
                define_macros=ext_macros,
                extra_compile_args=ext_cflags,
                libraries=libraries,
            )
        )
    if not exts:
        return []
    from Cython.Build import cythonize

    directives = {
        "language_level": 3,
        "boundscheck": DEBUG,
        "wraparound": DEBUG,
        "initializedcheck": DEBUG,
        "cdivision": not DEBUG,
        "linetrace": DEBUG,
        "embedsignature": True,
    }
    # cythonize compares timestamps only: a change of build flavour (debug, no liburing)
    # must regenerate the C, or a debug build would silently reuse optimised code.
    flavour = f"debug={int(DEBUG)} uring={int(uring is not None)}\n"
    stamp = HERE / "build" / ".quillcache-flavour"
    force = not stamp.exists() or stamp.read_text() != flavour
    stamp.parent.mkdir(exist_ok=True)
    stamp.write_text(flavour)
    return cythonize(
        exts,
        force=force,
        compiler_directives=directives,
        compile_time_env={"QC_DEBUG": DEBUG, "QC_HAVE_LIBURING": uring is not None},
        include_path=[str(NATIVE.parent.parent)],
        quiet=True,
    )


setup(
    # Every package under src/ (quillcache, its subpackages, quillcache_cli): found, not listed,
    # so a new package cannot be left out of the wheel.
    package_dir={"": "src"},
    # _native/includes holds only .pxd/.h declarations: named as a package of data, so setuptools
    # neither drops it nor warns that an importable folder is missing from `packages`.
    packages=[*find_packages(where="src"), "quillcache._native.includes"],
    package_data={"quillcache._native": ["*.pyx", "*.pxd", "*.pxi"],
                  "quillcache._native.includes": ["*.pxd", "*.h"]},
    ext_modules=extensions(),
    # The extensions compile one per CPU in every build, a wheel's (`pip wheel`, `pip install .`)
    # as well as `make build`'s (which says -j 2): serially a wheel took 52 s on 2 cores, 30 s so.
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
    zip_safe=False,
)

"""Build hook: ship the fused-kernel CUDA source in the wheel.

``kernels/`` at the repository root stays the one source of truth (the CPU emulator in
``kernels/testing`` and the compile gate read it there). When a wheel or a regular install is
built, ``build_py`` copies ``kernels/*.cu`` to ``hpclb/_kernels/`` in the build tree only, so the
source tree never holds a second copy; ``hpclb.optim.fused.kernel_source()`` looks in the installed
package first, then in the repository's ``kernels/``.

One optional C extension: ``hpclb.data._jpeg_region`` (the train transform's JPEG region decode,
libjpeg-turbo's libjpeg API). It needs a C compiler and libjpeg-turbo's headers (Debian:
``apt-get install libjpeg-dev``); where they are missing the install goes on without it and the
loader decodes with simplejpeg or PIL (the same pixels, more slowly: docs/recipes.md). Everything
else is in setup.cfg.
"""
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).resolve().parent / "kernels"


class BuildPyWithKernels(build_py):
    """``build_py`` that also copies ``kernels/*.cu`` to ``<build_lib>/hpclb/_kernels/``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # editable installs read kernels/ in place
            return
        sources = sorted(KERNELS.glob("*.cu"))
        if not sources:
            raise FileNotFoundError(f"no CUDA sources in {KERNELS}: build hpclb from a full "
                                    "checkout or sdist (kernels/*.cu must be present)")
        target = Path(self.build_lib) / "hpclb" / "_kernels"
        target.mkdir(parents=True, exist_ok=True)
        for src in sources:
            shutil.copyfile(src, target / src.name)


JPEG_REGION = Extension("hpclb.data._jpeg_region", ["hpclb/data/_jpeg_region.c"],
                        libraries=["jpeg"], optional=True)

setup(cmdclass={"build_py": BuildPyWithKernels}, ext_modules=[JPEG_REGION])

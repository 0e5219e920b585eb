"""The native half of `pip install .`: builds the `wl_python` target with the project's CMake and
copies the extension into the package (pyproject.toml holds the rest).

The build directory is WEIGHTLIFT_BUILD_DIR, or build/release (configured with the `release`
preset when it is not yet), so an install after `scripts/build.sh` rebuilds nothing.
"""
import os
import shutil
import subprocess
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = os.environ.get("WEIGHTLIFT_BUILD_DIR") or os.path.join(ROOT, "build", "release")
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            if "WEIGHTLIFT_BUILD_DIR" in os.environ:
                raise RuntimeError(f"WEIGHTLIFT_BUILD_DIR={build_dir} is not a configured CMake "
                                   "build directory (no CMakeCache.txt)")
            subprocess.run(["cmake", "--preset", "release"], cwd=ROOT, check=True)
        subprocess.run(["cmake", "--build", build_dir, "--target", "wl_python", "-j",
                        str(os.cpu_count() or 1)], check=True)
        name = "_native" + sysconfig.get_config_var("EXT_SUFFIX")
        built = os.path.join(build_dir, "python", "weightlift", name)
        if not os.path.exists(built):
            raise RuntimeError(f"the build left no {built}; is WL_BUILD_PYTHON off?")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built, target)


setup(ext_modules=[Extension("weightlift._native", sources=[])],
      cmdclass={"build_ext": CMakeBuild})

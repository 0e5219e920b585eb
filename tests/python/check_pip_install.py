"""`pip install .` from the checkout as the README says (a venv that sees Debian's packages, no
download, no build isolation); then the package's tests that cross processes run against the
installed copy, not the build's.

Usage: check_pip_install.py <source dir> <build dir>   (WEIGHTLIFT_EXE: the launcher binary)
Run by CTest; the install reuses <build dir> (setup.py's WEIGHTLIFT_BUILD_DIR), so it builds
nothing the release build has not."""
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The package tests across processes and one of its in-process checks: enough to show the
# installed extension and Python files work together, while test_package.py runs them all.
SELECTED = ("test_collectives_across_processes or test_server_to_receivers_exact_zero_copy "
            "or test_a_job_of_one")


def run(cmd, env=None, cwd=None):
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"FAIL {' '.join(cmd)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    source, build = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory(prefix="wl-pip-") as root:
        venv = os.path.join(root, "venv")
        run([sys.executable, "-m", "venv", "--system-site-packages", venv])
        python = os.path.join(venv, "bin", "python")
        env = dict(os.environ, WEIGHTLIFT_BUILD_DIR=build)
        env.pop("PYTHONPATH", None)
        run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
             source], env=env)
        where = run([python, "-c", "import weightlift; print(weightlift.__file__)"], env=env,
                    cwd=root).strip()
        if not where.startswith(venv):
            sys.exit(f"FAIL `import weightlift` found {where}, not the installed copy")
        package = os.path.dirname(where)
        natives = glob.glob(os.path.join(package, "_native*.so"))
        for path in [os.path.join(package, f) for f in ("_native.pyi", "py.typed")]:
            if not os.path.isfile(path):
                sys.exit(f"FAIL the install holds no {path}")
        if len(natives) != 1 or os.path.islink(natives[0]):
            sys.exit(f"FAIL the install's extension: {natives} (one regular file expected)")
        # The ranks test_package.py launches run sys.executable: the venv's python.
        out = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECTED,
                   os.path.join(HERE, "test_package.py")], env=env, cwd=root)
        print(out.strip().splitlines()[-1])
        print(f"ok   pip install . put the package in {package} and its tests pass against it")


if __name__ == "__main__":
    main()

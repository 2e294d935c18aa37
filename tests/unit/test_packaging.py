"""What installing kvplane brings: its runtime dependencies, and no pytest plugin in other people's sessions.

The session test builds an environment by hand (nothing is downloaded): a directory holding pytest and its own
dependencies, linked from the running environment, and kvplane as this checkout's pyproject declares it (a
dist-info with its entry points). Python runs there with ``-S``, so no other installed metadata is seen.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted(ROOT.glob("backends/*/pyproject.toml"))]
PYTEST_DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")


def project(path: Path = ROOT / "pyproject.toml") -> dict:  # type: ignore[type-arg]
    with path.open("rb") as f:
        return dict(tomllib.load(f)["project"])


def requirement_names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for r in requirements}


def test_runtime_dependencies_are_what_runtime_needs() -> None:
    runtime = requirement_names(project()["dependencies"])
    assert runtime == {"torch", "pluggy", "numpy", "msgspec", "pyzmq"}
    extras = project()["optional-dependencies"]
    assert "pytest" in requirement_names(extras["conformance"])
    assert "rich" in requirement_names(extras["bench"])


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_distribution_declares_a_pytest11_plugin(pyproject: Path) -> None:
    assert "pytest11" not in project(pyproject).get("entry-points", {})


def link_distribution(name: str, site: Path) -> None:
    dist = importlib.metadata.distribution(name)
    for file in dist.files or ():
        if file.parts[0] == ".." or file.suffix == ".pyc":
            continue  # scripts outside site-packages, caches
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(Path(str(dist.locate_file(file))).resolve())


def install_kvplane_metadata(site: Path) -> None:
    """The dist-info ``pip install kvplane`` writes, from this checkout's pyproject (the code stays in ROOT)."""
    meta = project()
    info = site / f"kvplane-{meta['version']}.dist-info"
    info.mkdir()
    requires = "".join(f"Requires-Dist: {r}\n" for r in meta["dependencies"])
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvplane\nVersion: {meta['version']}\n{requires}")
    entry_points = configparser.ConfigParser()
    for group, entries in meta.get("entry-points", {}).items():
        entry_points[group] = entries
    with (info / "entry_points.txt").open("w") as f:
        entry_points.write(f)


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    site = tmp_path_factory.mktemp("site-packages")
    for name in PYTEST_DISTRIBUTIONS:
        try:
            link_distribution(name, site)
        except importlib.metadata.PackageNotFoundError:
            continue  # a dependency this pytest does not have
    install_kvplane_metadata(site)
    work = tmp_path_factory.mktemp("session")
    (work / "test_someone_elses.py").write_text(
        "import sys\n\n"
        "def test_kvplane_is_installed_but_its_plugin_is_not_loaded(pytestconfig):\n"
        "    import importlib.metadata\n"
        "    assert importlib.metadata.version('kvplane')\n"
        "    names = [name for name, _ in pytestconfig.pluginmanager.list_name_plugin()]\n"
        "    assert not [n for n in names if 'kvplane' in str(n)], names\n"
        "    assert not [m for m in sys.modules if m.startswith('kvplane')]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    return work, env


def run_pytest(environment: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    work, env = environment
    return subprocess.run([sys.executable, "-S", "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=work,
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_pytest_session_where_kvplane_is_installed_does_not_load_the_conformance_plugin(
    environment: tuple[Path, dict[str, str]],
) -> None:
    proc = run_pytest(environment, "test_someone_elses.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_its_options_exist_only_when_the_plugin_is_asked_for(environment: tuple[Path, dict[str, str]]) -> None:
    proc = run_pytest(environment, "--kvplane-device=cpu", "test_someone_elses.py")
    assert proc.returncode == 4  # pytest's usage error
    assert "unrecognized arguments: --kvplane-device=cpu" in proc.stderr


WITHOUT_EXTRAS = """
import sys
class Block:  # an environment where only the runtime dependencies are installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest", "rich", "matplotlib"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
from kvplane.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def kvplane_without_extras(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVPLANE_DEVICE"}
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_kvplane_runs_without_pytest_rich_or_matplotlib_and_names_the_extra_a_command_needs() -> None:
    info = kvplane_without_extras("info")
    assert info.returncode == 0, info.stderr
    assert "cpu    available" in info.stdout
    conformance = kvplane_without_extras("conformance", "--device", "cpu")
    assert conformance.returncode == 2 and "pip install 'kvplane[conformance]'" in conformance.stderr
    listing = kvplane_without_extras("bench", "--list")  # the bench's table needs no extra; only its plot does
    assert listing.returncode == 0 and "offload" in listing.stdout, listing.stderr

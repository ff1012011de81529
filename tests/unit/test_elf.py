"""The rootfs resolver (envctl.host.elf, envctl.host.ldcache) against this host's real binaries,
with ldd (the loader in trace mode), ldconfig and running the programs as the oracles, and
against small programs and fake roots built with gcc in tmp_path. No root needed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envctl.facts import PlacedFile
from envctl.host.elf import (
    DEFAULT_PATH,
    closure,
    driver_libraries,
    find_program,
    glob_libraries,
    python_runtime,
    read_elf,
    resolve_rootfs,
    top_links,
)
from envctl.host.ldcache import LdCache, host_machine, parse

needs_x86_64 = pytest.mark.skipif(host_machine() != "x86_64",
                                  reason="the built test objects and paths are x86-64 ones")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
needs_ldd = pytest.mark.skipif(shutil.which("ldd") is None, reason="ldd is not installed")
needs_ldconfig = pytest.mark.skipif(
    shutil.which("ldconfig") is None and not os.path.exists("/sbin/ldconfig"),
    reason="ldconfig is not installed")


def _run(*argv: str | Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([os.fspath(a) for a in argv], capture_output=True, text=True,
                          check=True, **kw)


def _ldd(*paths: str) -> tuple[set[str], set[str]]:
    """The real paths of what ld.so maps for `paths` (ldd), and the names it did not find."""
    found, missing = set(), set()
    out = subprocess.run(["ldd", *paths], capture_output=True, text=True).stdout
    for line in out.splitlines():
        words = line.split()
        if not words or words[0].startswith("linux-vdso") or line.endswith(":"):
            continue  # (with several files, ldd heads each one's list with "PATH:")
        if "=>" in words:
            target = words[words.index("=>") + 1]
            if target == "not":
                missing.add(words[0])
            else:
                found.add(os.path.realpath(target))
        elif words[0].startswith("/"):
            found.add(os.path.realpath(words[0]))
    return found, missing


def _real_files(files: list[PlacedFile]) -> set[str]:
    return {f.path for f in files if not f.link}


def _resolve(files: list[PlacedFile], links: tuple[tuple[str, str], ...], path: str) -> str:
    """Follow `path` through the tree the PlacedFiles and top-level links describe (what
    the environment will hold) to a placed regular file; AssertionError if it leads nowhere."""
    placed = {f.path: f for f in files}
    top = {f"/{name}": target for name, target in links}
    parts = [p for p in path.split("/") if p]
    current = ""
    for _ in range(100):
        if not parts:
            break
        name = parts.pop(0)
        candidate = f"{current}/{name}" if name != ".." else current.rsplit("/", 1)[0]
        target = top.get(candidate)
        if target is None and candidate in placed and placed[candidate].link:
            target = placed[candidate].link
        if target is None:
            current = candidate
            continue
        parts = [p for p in target.split("/") if p] + parts
        current = "" if target.startswith("/") else current
    assert current in placed and not placed[current].link, f"{path} leads to {current}"
    return current


def _gcc(tmp: Path, *args: str | Path) -> None:
    result = subprocess.run(["gcc", *map(os.fspath, args)], capture_output=True, text=True,
                            cwd=tmp)
    if result.returncode:
        pytest.skip(f"gcc cannot build the test object: {result.stderr.strip()[-200:]}")


def _source(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


# ---- the host's own programs, against ldd --------------------------------------------------


@needs_ldd
@needs_x86_64
@pytest.mark.parametrize("program", ["bash", "python3"])
def test_closure_of_host_programs_is_what_ld_so_maps(program):
    path = find_program(program)
    if path is None:
        pytest.skip(f"no {program} on {DEFAULT_PATH}")
    files, missing = closure([path])
    assert missing == []
    expected, not_found = _ldd(path)
    assert not not_found
    assert _real_files(files) == expected | {os.path.realpath(path)}
    assert any("/libc.so.6" in f for f in _real_files(files))
    if program == "bash":
        assert any("/libtinfo.so" in f for f in _real_files(files))
    # Inside the environment the program, its interpreter (at exactly PT_INTERP) and every
    # library path ldd printed (as found, e.g. /lib/x86_64-linux-gnu/libc.so.6) resolve.
    links = top_links()
    _resolve(files, links, path)
    _resolve(files, links, read_elf(path).interp)
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        words = line.split()
        if "=>" in words and words[words.index("=>") + 1].startswith("/"):
            _resolve(files, links, words[words.index("=>") + 1])
    # Sorted by path, each path once, sources on this host.
    assert [f.path for f in files] == sorted({f.path for f in files})
    assert all(os.path.lexists(f.source) for f in files)


@needs_x86_64
def test_a_symlinked_program_brings_the_link_and_its_target():
    python = find_program("python3")
    if python is None or not os.path.islink(python):
        pytest.skip("python3 is not a symlink here")
    files, _ = closure([python])
    placed = {f.path: f for f in files}
    canonical = os.path.join(os.path.realpath(os.path.dirname(python)), os.path.basename(python))
    assert placed[canonical].link == os.readlink(python)
    assert os.path.realpath(python) in _real_files(files)


# ---- programs built here ---------------------------------------------------------------------


FOO = "int foo(void) { return 42; }\n"
MAIN = ("#include <stdio.h>\nint foo(void);\n"
        "int main(void) { printf(\"%d\\n\", foo()); return 0; }\n")


def _app(tmp: Path, tags: str, rpath: str = "$ORIGIN/../lib") -> Path:
    """tmp/app/bin/prog needing libfoo.so.1 from tmp/app/lib, found through `rpath`."""
    (tmp / "app/bin").mkdir(parents=True)
    (tmp / "app/lib").mkdir()
    _gcc(tmp, "-shared", "-fPIC", "-Wl,-soname,libfoo.so.1", "-o", tmp / "app/lib/libfoo.so.1",
         _source(tmp, "foo.c", FOO))
    _gcc(tmp, "-o", tmp / "app/bin/prog", _source(tmp, "main.c", MAIN), "-L", tmp / "app/lib",
         "-l:libfoo.so.1", f"-Wl,-rpath,{rpath}", f"-Wl,--{tags}-new-dtags")
    return tmp / "app/bin/prog"


@needs_gcc
@needs_x86_64
@pytest.mark.parametrize("tags", ["enable", "disable"])
def test_origin_finds_the_library_next_to_the_program_wherever_it_is(tmp_path, tags):
    prog = _app(tmp_path, tags)
    info = read_elf(str(prog))
    # --enable-new-dtags writes DT_RUNPATH, --disable-new-dtags DT_RPATH.
    assert (info.runpath, info.rpath) == (
        ("$ORIGIN/../lib", None) if tags == "enable" else (None, "$ORIGIN/../lib"))
    files, missing = closure([str(prog)])
    assert missing == []
    assert str(tmp_path / "app/lib/libfoo.so.1") in _real_files(files)
    assert _real_files(files) == _ldd(str(prog))[0] | {str(prog)}
    # Copied elsewhere, $ORIGIN follows the copy.
    shutil.copytree(tmp_path / "app", tmp_path / "copy")
    files, missing = closure([str(tmp_path / "copy/bin/prog")])
    assert missing == []
    assert str(tmp_path / "copy/lib/libfoo.so.1") in _real_files(files)
    assert str(tmp_path / "app/lib/libfoo.so.1") not in _real_files(files)


@needs_gcc
@needs_x86_64
def test_origin_of_a_program_reached_through_a_symlink_is_its_real_directory(tmp_path):
    # The kernel gives ld.so the program as /proc/self/exe (symlinks resolved), so
    # $ORIGIN/../lib is next to the real file, not next to the link. The link sits two levels
    # down so that <link dir>/../lib does not exist; running it is the oracle (ldd would not
    # do: it starts the program through ld.so by the path given).
    prog = _app(tmp_path, "enable")
    (tmp_path / "x/y").mkdir(parents=True)
    link = tmp_path / "x/y/prog"
    link.symlink_to("../../app/bin/prog")
    assert subprocess.run([link], capture_output=True, text=True).stdout == "42\n"
    files, missing = closure([str(link)])
    assert missing == []
    assert str(tmp_path / "app/lib/libfoo.so.1") in _real_files(files)
    placed = {f.path: f for f in files}
    assert placed[str(link)].link == "../../app/bin/prog"
    assert str(prog) in _real_files(files)


@needs_gcc
@needs_ldd
@needs_x86_64
@pytest.mark.parametrize("tags", ["enable", "disable"])
def test_rpath_serves_the_libraries_a_program_loads_and_runpath_does_not(tmp_path, tags):
    # prog -> libbar.so.1 -> libfoo.so.1, only prog has $ORIGIN/../lib. ld.so searches a
    # loader's DT_RPATH for its dependencies' needs too, DT_RUNPATH only for its own.
    lib = tmp_path / "app/lib"
    lib.mkdir(parents=True)
    (tmp_path / "app/bin").mkdir()
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libfoo.so.1", "-o", lib / "libfoo.so.1",
         _source(tmp_path, "foo.c", FOO))
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libbar.so.1", "-o", lib / "libbar.so.1",
         _source(tmp_path, "bar.c", "int foo(void);\nint bar(void) { return foo(); }\n"),
         "-L", lib, "-l:libfoo.so.1")
    prog = tmp_path / "app/bin/prog"
    _gcc(tmp_path, "-o", prog, _source(tmp_path, "main.c", "int bar(void);\n"
                                       "int main(void) { return bar() == 42 ? 0 : 1; }\n"),
         "-L", lib, "-l:libbar.so.1", f"-Wl,-rpath-link,{lib}", "-Wl,-rpath,$ORIGIN/../lib",
         f"-Wl,--{tags}-new-dtags")
    files, missing = closure([str(prog)])
    ldd_found, ldd_missing = _ldd(str(prog))
    assert str(lib / "libbar.so.1") in _real_files(files)
    if tags == "disable":
        assert missing == [] and not ldd_missing
        assert str(lib / "libfoo.so.1") in _real_files(files)
    else:
        assert ldd_missing == {"libfoo.so.1"}
        assert [m[0] for m in missing] == ["libfoo.so.1"]
        # Named as ld.so names it: the RUNPATH entry it was found in, $ORIGIN expanded.
        assert missing[0][1].startswith(f"needed by {tmp_path}/app/bin/../lib/libbar.so.1; "
                                        "not in ld.so.cache or the default directories")
        assert str(lib / "libfoo.so.1") not in _real_files(files)
    assert _real_files(files) == ldd_found | {str(prog)}


@needs_gcc
@needs_ldd
@needs_x86_64
def test_rpath_of_every_loader_up_the_chain_is_searched(tmp_path):
    # prog (RPATH lib) -> libmid (RPATH $ORIGIN/sub) -> libleaf (none) -> libdeep, which is only
    # in lib/sub: found through libmid's RPATH, the loader of libleaf, not through prog's.
    lib = tmp_path / "app/lib"
    (lib / "sub").mkdir(parents=True)
    (tmp_path / "app/bin").mkdir()
    src = _source(tmp_path, "x.c", FOO)
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libdeep.so.1", "-o", lib / "sub/libdeep.so.1",
         src)
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libleaf.so.1", "-o", lib / "libleaf.so.1",
         src, "-Wl,--no-as-needed", "-L", lib / "sub", "-l:libdeep.so.1")
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libmid.so.1", "-o", lib / "libmid.so.1", src,
         "-Wl,--no-as-needed", "-L", lib, "-l:libleaf.so.1", f"-Wl,-rpath-link,{lib}/sub",
         "-Wl,-rpath,$ORIGIN/sub", "-Wl,--disable-new-dtags")
    prog = tmp_path / "app/bin/prog"
    _gcc(tmp_path, "-o", prog, _source(tmp_path, "main.c", "int main(void) { return 0; }\n"),
         "-Wl,--no-as-needed", "-L", lib, "-l:libmid.so.1", f"-Wl,-rpath-link,{lib}:{lib}/sub",
         "-Wl,-rpath,$ORIGIN/../lib", "-Wl,--disable-new-dtags")
    files, missing = closure([str(prog)])
    assert missing == []
    assert str(lib / "sub/libdeep.so.1") in _real_files(files)
    assert _real_files(files) == _ldd(str(prog))[0] | {str(prog)}


@needs_gcc
@needs_x86_64
def test_a_library_for_another_machine_is_skipped_as_ld_so_skips_it(tmp_path):
    # An i386 libfoo.so.1 earlier in RUNPATH than the x86-64 one: ld.so passes over it.
    if not (shutil.which("as") and shutil.which("ld")):
        pytest.skip("binutils (as, ld) not installed")
    prog = _app(tmp_path, "enable", rpath="$ORIGIN/../lib32:$ORIGIN/../lib")
    (tmp_path / "app/lib32").mkdir()
    _i386_library(tmp_path, tmp_path / "app/lib32/libfoo.so.1", "libfoo.so.1")
    files, missing = closure([str(prog)])
    assert missing == []
    assert str(tmp_path / "app/lib/libfoo.so.1") in _real_files(files)
    assert str(tmp_path / "app/lib32/libfoo.so.1") not in _real_files(files)
    assert subprocess.run([prog], capture_output=True, text=True).stdout == "42\n"
    # With only the i386 one there, the library is missing, and the message says why.
    (tmp_path / "app/lib/libfoo.so.1").unlink()
    files, missing = closure([str(prog)])
    assert [m[0] for m in missing] == ["libfoo.so.1"]
    assert missing[0][1].endswith(
        f"skipped for another machine: {tmp_path}/app/bin/../lib32/libfoo.so.1 (i386)")


def _i386_library(tmp: Path, out: Path, soname: str) -> None:
    (tmp / "f32.s").write_text(".text\n.globl foo\nfoo:\n\tmovl $42, %eax\n\tret\n")
    _run("as", "--32", "-o", tmp / "f32.o", tmp / "f32.s")
    _run("ld", "-m", "elf_i386", "-shared", "-soname", soname, "-o", out, tmp / "f32.o")


@needs_gcc
@needs_x86_64
def test_openmp_program_needs_libgomp(tmp_path):
    src = _source(tmp_path, "omp.c", "#include <omp.h>\n#include <stdio.h>\n"
                  "int main(void) { printf(\"%d\\n\", omp_get_max_threads()); return 0; }\n")
    _gcc(tmp_path, "-fopenmp", "-o", tmp_path / "omp", src)
    files, missing = closure([str(tmp_path / "omp")])
    assert missing == []
    assert any("/libgomp.so" in f for f in _real_files(files))
    if shutil.which("ldd"):
        assert _real_files(files) == _ldd(str(tmp_path / "omp"))[0] | {str(tmp_path / "omp")}


@needs_gcc
@needs_x86_64
def test_a_missing_library_is_reported_not_raised(tmp_path):
    prog = _app(tmp_path, "enable")
    (tmp_path / "app/lib/libfoo.so.1").unlink()
    files, missing = closure([str(prog), str(tmp_path / "nowhere")])
    assert missing[0][0] == "libfoo.so.1"
    why = missing[0][1]
    assert why.startswith(f"needed by {prog}; not in the RUNPATH of {prog}, ld.so.cache")
    assert "the default directories (" in why
    assert missing[1][0] == str(tmp_path / "nowhere")
    # What could be found still is: the program, libc, the interpreter.
    assert str(prog) in _real_files(files)
    assert any("/libc.so.6" in f for f in _real_files(files))


@needs_x86_64
def test_a_script_brings_its_interpreter_and_its_closure(tmp_path):
    script = _source(tmp_path, "job.sh", "#!/bin/sh -e\necho hi\n")
    data = _source(tmp_path, "data.txt", "no closure\n")
    files, missing = closure([str(script), str(data)])
    assert missing == []
    real = _real_files(files)
    assert {str(script), str(data), os.path.realpath("/bin/sh")} <= real
    assert real == {str(script), str(data)} | _ldd("/bin/sh")[0] | {os.path.realpath("/bin/sh")}
    # `#!/usr/bin/env python3` also brings the python3 env would start.
    python = find_program("python3")
    if python and os.path.exists("/usr/bin/env"):
        script = _source(tmp_path, "job.py", "#!/usr/bin/env python3\nprint(1)\n")
        files, missing = closure([str(script)])
        assert missing == []
        assert {os.path.realpath("/usr/bin/env"), os.path.realpath(python)} <= _real_files(files)


def test_a_relative_or_empty_interpreter_is_reported(tmp_path):
    files, missing = closure([str(_source(tmp_path, "a", "#!python3\n")),
                              str(_source(tmp_path, "b", "#!\n")),
                              str(_source(tmp_path, "c", "#! /no/such/interp -x\n"))])
    assert missing == [("python3", f"named on the #! line of {tmp_path}/a: not an absolute path"),
                       (f"{tmp_path}/b", "its #! line names no interpreter"),
                       ("/no/such/interp", "no such file (or not a regular file); named on "
                                           f"the #! line of {tmp_path}/c")]
    assert _real_files(files) == {f"{tmp_path}/a", f"{tmp_path}/b", f"{tmp_path}/c"}


# ---- a fake root -------------------------------------------------------------------------------


@needs_gcc
@needs_x86_64
def test_closure_inside_a_root_keeps_absolute_links_inside_it(tmp_path):
    # <root>/opt/app/current -> /opt/app/v1 (absolute: must mean <root>/opt/app/v1), the
    # program's RUNPATH goes through it, PT_INTERP is the host's. Sources are host paths under
    # root, paths are the environment's; the directory link is placed so RUNPATH works there.
    root = tmp_path / "root"
    (root / "opt/app/v1/lib").mkdir(parents=True)
    (root / "opt/app/current").symlink_to("/opt/app/v1")
    (root / "usr/bin").mkdir(parents=True)
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libfoo.so.1", "-o",
         root / "opt/app/v1/lib/libfoo.so.1", _source(tmp_path, "foo.c", FOO))
    _gcc(tmp_path, "-o", root / "usr/bin/prog", _source(tmp_path, "main.c", MAIN),
         "-L", root / "opt/app/v1/lib", "-l:libfoo.so.1", "-Wl,-rpath,/opt/app/current/lib",
         "-Wl,--enable-new-dtags")
    interp = read_elf(str(root / "usr/bin/prog")).interp
    (root / interp[1:]).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.realpath(interp), root / interp[1:])
    files, missing = closure(["/usr/bin/prog"], root=root)
    placed = {f.path: f for f in files}
    assert placed["/opt/app/current"] == PlacedFile("/opt/app/current",
                                                    f"{root}/opt/app/current", "/opt/app/v1")
    assert placed["/opt/app/v1/lib/libfoo.so.1"].source == f"{root}/opt/app/v1/lib/libfoo.so.1"
    assert placed["/usr/bin/prog"].source == f"{root}/usr/bin/prog"
    assert interp in placed
    # No libc in this root and no cache: reported, with the directories searched.
    assert [m[0] for m in missing] == ["libc.so.6"]
    assert "/usr/lib/x86_64-linux-gnu" not in missing[0][1]  # no multiarch dir in this root
    assert "the default directories (/lib64, /usr/lib64)" in missing[0][1]


def test_find_program_looks_in_path_order_and_wants_an_executable_file(tmp_path):
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    (tmp_path / "a/tool").write_text("not executable")
    (tmp_path / "b/tool").write_text("#!/bin/sh\n")
    (tmp_path / "b/tool").chmod(0o755)
    (tmp_path / "c/tool").symlink_to("../b/tool")
    (tmp_path / "a/dir").mkdir()
    (tmp_path / "a/dir").chmod(0o755)
    path = "/a:/b:/c"
    assert find_program("tool", root=tmp_path, path=path) == "/b/tool"
    assert find_program("tool", root=tmp_path, path="/c:/b") == "/c/tool"  # as found
    assert find_program("/a/tool", root=tmp_path) is None  # not executable
    assert find_program("/b/tool", root=tmp_path) == "/b/tool"
    assert find_program("dir", root=tmp_path, path=path) is None
    assert find_program("nope", root=tmp_path, path=path) is None
    assert find_program("b/tool", root=tmp_path, path=path) is None
    assert find_program("sh") in {"/usr/bin/sh", "/bin/sh"}


def test_top_links_are_the_top_level_directories_that_are_links(tmp_path):
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib64").symlink_to("/usr/lib64")
    (tmp_path / "lib").mkdir()
    (tmp_path / "etc").symlink_to("usr/etc")  # not one of the six
    assert top_links(tmp_path) == (("bin", "usr/bin"), ("lib64", "/usr/lib64"))
    assert top_links(tmp_path / "missing") == ()


# ---- ld.so.cache -------------------------------------------------------------------------------


def _ldconfig_p(cache: Path) -> list[tuple[str, str]]:
    """(soname, path) of each entry as `ldconfig -p` prints them, in its order."""
    out = _run(shutil.which("ldconfig") or "/sbin/ldconfig", "-p", "-C", cache).stdout
    entries = []
    for line in out.splitlines()[1:]:
        if "=>" in line:
            left, _, path = line.partition(" => ")
            entries.append((left.split()[0], path.strip()))
    return entries


@needs_ldconfig
@needs_ldd
@needs_x86_64
def test_ld_so_cache_of_this_host_reads_as_ldconfig_and_ld_so_read_it():
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no /etc/ld.so.cache")
    cache = LdCache.load()
    assert cache.problem == ""
    assert list(cache.names()) == _ldconfig_p(Path("/etc/ld.so.cache"))
    libc = next(line.split()[2] for line in _run("ldd", "/bin/sh").stdout.splitlines()
                if line.split()[0] == "libc.so.6")
    assert cache.lookup("libc.so.6", "x86_64") == libc
    assert cache.lookup("libc.so.6", "aarch64") is None
    assert cache.lookup("no-such-lib.so.1", "x86_64") is None


def _ldconfig_root(root: Path, *args: str) -> None:
    """ldconfig -r ROOT (it chroots: as root, or as root of a new user namespace)."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    argv = [ldconfig, "-r", str(root), *args]
    if os.geteuid() != 0:
        argv = ["unshare", "--user", "--map-root-user", *argv]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot run ldconfig -r: {result.stderr.strip()[-200:]}")


@needs_gcc
@needs_ldconfig
@needs_x86_64
@pytest.mark.parametrize("fmt", ["new", "compat", "old"])
def test_ld_so_cache_built_by_ldconfig_gives_each_machine_its_own_library(tmp_path, fmt):
    if not (shutil.which("as") and shutil.which("ld")):
        pytest.skip("binutils (as, ld) not installed")
    root = tmp_path / "root"
    lib64, lib32 = root / "usr/lib/x86_64-linux-gnu", root / "usr/lib/i386-linux-gnu"
    lib64.mkdir(parents=True)
    lib32.mkdir(parents=True)
    (root / "etc").mkdir()
    # i386 first in the configuration, so the i386 entry precedes in the cache: x86-64
    # programs must still get theirs.
    (root / "etc/ld.so.conf").write_text("/usr/lib/i386-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")
    _gcc(tmp_path, "-shared", "-fPIC", "-Wl,-soname,libdual.so.1", "-o", lib64 / "libdual.so.1.0",
         _source(tmp_path, "foo.c", FOO))
    _i386_library(tmp_path, lib32 / "libdual.so.1.0", "libdual.so.1")
    _ldconfig_root(root, "-c", fmt)
    cache = LdCache.load(root)
    assert cache.problem == ""
    assert list(cache.names()) == _ldconfig_p(root / "etc/ld.so.cache")
    assert cache.lookup("libdual.so.1", "x86_64") == "/usr/lib/x86_64-linux-gnu/libdual.so.1"
    assert cache.lookup("libdual.so.1", "i386") == "/usr/lib/i386-linux-gnu/libdual.so.1"
    assert ("libdual.so.1", "/usr/lib/i386-linux-gnu/libdual.so.1") not in cache.names("x86_64")
    # ldconfig made the soname link; the closure of the library through the cache has both.
    found, missing = glob_libraries(["libdual*"], cache, root)
    assert (found, missing) == (["/usr/lib/x86_64-linux-gnu/libdual.so.1"], [])


def test_a_missing_or_broken_cache_is_an_empty_one(tmp_path):
    assert LdCache.load(tmp_path).entries == ()
    assert LdCache.load(tmp_path).problem == ""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.cache").write_bytes(b"glibc-ld.so.cache1.1" + b"\xff" * 40)
    broken = LdCache.load(tmp_path)
    assert broken.entries == ()
    assert "ld.so.cache" in broken.problem and "entries do not fit" in broken.problem
    with pytest.raises(ValueError, match="not an ld.so.cache"):
        parse(b"garbage" * 10)


@needs_x86_64
def test_glob_libraries_matches_sonames_in_the_cache_and_paths_on_disk(tmp_path):
    cache = LdCache.load()
    if cache.lookup("libz.so.1", "x86_64") is None:
        pytest.skip("no libz.so.1 in this host's ld.so.cache")
    found, missing = glob_libraries(["libz.so*", "libno-such-thing*.so*"], cache)
    assert cache.lookup("libz.so.1", "x86_64") in found
    assert missing == [("libno-such-thing*.so*", "no library in ld.so.cache matches")]
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/libx.so.1").write_bytes(b"\x7fELF")
    (tmp_path / "lib/other").write_text("")
    found, missing = glob_libraries(["/lib/libx*", "/lib/liby*", "lib/libx*"], cache,
                                    root=tmp_path)
    assert found == ["/lib/libx.so.1"]
    assert missing == [("/lib/liby*", "no file matches"), ("lib/libx*", "not an absolute path")]


# ---- Python ------------------------------------------------------------------------------------


@needs_x86_64
def test_python_runtime_of_this_host():
    runtime = python_runtime()
    if runtime is None:
        pytest.skip(f"no python3 on {DEFAULT_PATH}")
    interpreter, stdlib, modules = runtime
    assert interpreter == find_program("python3")
    assert stdlib and all(os.path.exists(f"{d}/os.py") or d.endswith("lib-dynload")
                          for d in stdlib)
    assert modules and all(m.endswith(".so") and Path(m).read_bytes()[:4] == b"\x7fELF"
                           for m in modules)
    # Not this process's interpreter's library when that is elsewhere (a venv's base).
    assert all(os.path.basename(d).startswith("python3") or d.endswith("lib-dynload")
               for d in stdlib)


@needs_gcc
def test_python_runtime_is_derived_from_the_real_file_without_running_it(tmp_path):
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    dynload = root / "usr/lib/python3.11/lib-dynload"
    dynload.mkdir(parents=True)
    (root / "usr/bin/python3.11").write_text("not even a program: never run")
    (root / "usr/bin/python3.11").chmod(0o755)
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "usr/lib/python3.11/os.py").write_text("")
    _gcc(tmp_path, "-shared", "-fPIC", "-o", dynload / "_x.cpython-311-x86_64-linux-gnu.so",
         _source(tmp_path, "foo.c", FOO))
    (dynload / "README.so").write_text("not ELF")
    assert python_runtime(root) == (
        "/usr/bin/python3", ["/usr/lib/python3.11"],
        ["/usr/lib/python3.11/lib-dynload/_x.cpython-311-x86_64-linux-gnu.so"])
    (root / "usr/lib/python3.11/os.py").unlink()
    assert python_runtime(root) == (
        "/usr/bin/python3", ["/usr/lib/python3.11/lib-dynload"],
        ["/usr/lib/python3.11/lib-dynload/_x.cpython-311-x86_64-linux-gnu.so"])
    assert python_runtime(tmp_path / "empty") is None


@needs_x86_64
def test_resolve_rootfs_of_this_host():
    python = find_program("python3")
    if python is None:
        pytest.skip(f"no python3 on {DEFAULT_PATH}")
    facts = resolve_rootfs(["bash", "no-such-program-x"], ["libz.so*", "libnope-x*"],
                           python=True)
    assert facts == resolve_rootfs(["bash", "no-such-program-x"], ["libz.so*", "libnope-x*"],
                                   python=True)
    assert facts.python == python
    assert facts.links == top_links()
    assert facts.missing == (
        ("binary no-such-program-x", "not found in PATH dirs /usr/local/sbin, /usr/local/bin, "
                                     "/usr/sbin, /usr/bin, /sbin, /bin (an executable regular "
                                     "file)"),
        ("library libnope-x*", "no library in ld.so.cache matches"))
    paths = [f.path for f in facts.files]
    assert paths == sorted(set(paths))
    if os.path.exists("/etc/ld.so.cache"):  # the loader inside reads the same cache
        assert PlacedFile("/etc/ld.so.cache", "/etc/ld.so.cache") in facts.files
    real = {f.path for f in facts.files if not f.link}
    assert os.path.realpath(python) in real and os.path.realpath("/usr/bin/bash") in real
    # The standard library is bound, not copied; what its extension modules need is placed.
    assert not any(p.startswith(tuple(f"{b}/" for b in facts.binds)) for p in paths)
    _, _, modules = python_runtime()
    if shutil.which("ldd"):
        needed = _ldd(*modules)[0]
        assert needed and needed - set(modules) <= real
    # A link in the standard library that points out of it (Debian's sitecustomize.py).
    for b in facts.binds:
        for entry in os.scandir(b):
            target = os.path.realpath(entry.path)
            if entry.is_symlink() and os.path.isfile(target) and \
                    not target.startswith(tuple(f"{x}/" for x in facts.binds)):
                assert target in real


# ---- NVIDIA driver -----------------------------------------------------------------------------


def test_no_driver_no_libraries(tmp_path):
    assert driver_libraries("", tmp_path) == []


@needs_gcc
@needs_ldconfig
@needs_x86_64
def test_driver_libraries_are_the_running_versions_with_their_soname_links(tmp_path):
    root = tmp_path / "root"
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text("/usr/lib/x86_64-linux-gnu\n")
    src = _source(tmp_path, "x.c", FOO)
    for soname, file in [
        ("libcuda.so.1", "libcuda.so.550.54.15"),
        ("libnvidia-ml.so.1", "libnvidia-ml.so.550.54.15"),
        # Another driver's library whose soname nothing else has: in the cache, not chosen.
        ("libnvidia-cfg.so.1", "libnvidia-cfg.so.535.104.05"),
        # No soname link: ldconfig caches the file under its own name.
        ("libnvidia-gpucomp.so.550.54.15", "libnvidia-gpucomp.so.550.54.15"),
        # Not one of the driver's libraries, though it carries the version.
        ("libother.so.1", "libother.so.550.54.15"),
    ]:
        _gcc(tmp_path, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", lib / file, src)
    (lib / "libcuda.so").symlink_to("libcuda.so.1")  # a development link
    _ldconfig_root(root)
    cache = LdCache.load(root)
    assert cache.lookup("libnvidia-cfg.so.1", "x86_64")  # present, but another version
    base = "/usr/lib/x86_64-linux-gnu"
    assert driver_libraries("550.54.15", root) == [
        PlacedFile(f"{base}/libcuda.so.1", f"{root}{base}/libcuda.so.1", "libcuda.so.550.54.15"),
        PlacedFile(f"{base}/libcuda.so.550.54.15", f"{root}{base}/libcuda.so.550.54.15"),
        PlacedFile(f"{base}/libnvidia-gpucomp.so.550.54.15",
                   f"{root}{base}/libnvidia-gpucomp.so.550.54.15"),
        PlacedFile(f"{base}/libnvidia-ml.so.1", f"{root}{base}/libnvidia-ml.so.1",
                   "libnvidia-ml.so.550.54.15"),
        PlacedFile(f"{base}/libnvidia-ml.so.550.54.15",
                   f"{root}{base}/libnvidia-ml.so.550.54.15"),
    ]
    assert driver_libraries("535.104.05", root, cache) == [
        PlacedFile(f"{base}/libnvidia-cfg.so.1", f"{root}{base}/libnvidia-cfg.so.1",
                   "libnvidia-cfg.so.535.104.05"),
        PlacedFile(f"{base}/libnvidia-cfg.so.535.104.05",
                   f"{root}{base}/libnvidia-cfg.so.535.104.05"),
    ]


def test_importing_the_module_does_not_import_pyelftools():
    code = ("import sys, envctl.host.elf, envctl.host.ldcache; "
            "print(any(m.startswith('elftools') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"

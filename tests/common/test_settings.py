"""Every environment variable is named, parsed and documented in one module (_common/settings.py):
docs/settings.md is what it generates, the shared parsers refuse a bad value with a sentence naming
the variable, the value and the fix, and no other module reads a variable by itself."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from sparkhvd._common import settings
from sparkhvd._common.settings import (
    COMMIT_MEMORY_BYTES,
    HOROVOD_ALIASES,
    HOROVOD_SPARK_START_TIMEOUT,
    KEEP_FAILED_LOGS,
    KEEP_LOGS,
    MAX_CONTROL_PAYLOAD,
    RANK,
    SCRIPT_FOLDER_MAX_BYTES,
    SCRIPT_FOLDER_MAX_FILES,
    SHIP_SCRIPT_FOLDER,
    Invalid,
    SettingError,
    byte_count,
    flag,
    integer,
    positive,
    seconds,
    whole,
)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_docs_settings_md_is_what_the_module_generates():
    on_disk = (ROOT / "docs" / "settings.md").read_text()
    assert on_disk == settings.markdown(), (
        "docs/settings.md is not what _common/settings.py generates; run "
        "`.venv/bin/python -m sparkhvd._common.settings > docs/settings.md`.")


def test_each_variable_is_defined_once_with_a_one_line_sentence_and_a_section():
    names = [s.name for s in settings.all_settings()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for s in settings.all_settings():
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", s.name), s.name
        assert s.doc and "\n" not in s.doc and "|" not in s.doc and s.doc.endswith("."), s.name
        assert s.section, f"{s.name} is defined before any section() in _common/settings.py"


def test_no_variable_is_both_read_and_listed_as_not_read():
    assert {s.name for s in settings.all_settings()} & set(settings.HOROVOD_NOT_READ) == set()


def test_the_module_level_names_are_the_settings():
    """Code reads ``settings.X``: every registered setting is reachable under a module-level name."""
    exported = {id(v) for v in vars(settings).values() if isinstance(v, settings.Setting)}
    assert [s.name for s in settings.all_settings() if id(s) not in exported] == []


# ---- reading a variable ----------------------------------------------------------------------------------


def test_unset_and_blank_give_the_default_and_raw_gives_the_text():
    assert KEEP_LOGS.get({}) == 5
    assert KEEP_LOGS.get({"SPARKHVD_KEEP_LOGS": "  "}) == 5
    assert KEEP_LOGS.get({"SPARKHVD_KEEP_LOGS": "7"}) == 7
    assert KEEP_LOGS.raw({"SPARKHVD_KEEP_LOGS": " 7"}) == " 7"
    assert KEEP_LOGS.raw({}) is None
    assert not KEEP_LOGS.is_set({"SPARKHVD_KEEP_LOGS": ""}) and KEEP_LOGS.is_set({"SPARKHVD_KEEP_LOGS": "0"})


def test_get_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv(KEEP_FAILED_LOGS.name, "3")
    assert KEEP_FAILED_LOGS.get() == 3
    monkeypatch.delenv(KEEP_FAILED_LOGS.name)
    assert KEEP_FAILED_LOGS.get() == 20


def test_a_setting_error_names_the_variable_the_value_and_the_fix():
    with pytest.raises(SettingError) as caught:
        KEEP_LOGS.value_of("many")
    assert str(caught.value) == ("SPARKHVD_KEEP_LOGS='many' is not a whole number >= 0; set it to how many successful "
                                 "runs' log folders to keep (default 5; 0 keeps none), or pass log_dir= to keep a run's "
                                 "logs where you choose.")
    assert isinstance(caught.value, ValueError)
    assert (caught.value.setting, caught.value.raw, caught.value.problem) == (KEEP_LOGS, "many",
                                                                              "is not a whole number >= 0")


def test_a_parser_may_write_the_value_its_own_way():
    error = SettingError(KEEP_LOGS, "-1", Invalid("must be 0 or more", "set it to e.g. 5.", shown="-1"))
    assert str(error) == "SPARKHVD_KEEP_LOGS=-1 must be 0 or more; set it to e.g. 5."


# ---- the shared parsers -----------------------------------------------------------------------------------


def _refusal(parse, raw: str) -> str:
    with pytest.raises(Invalid) as caught:
        parse(raw)
    return f"{caught.value.problem}; {caught.value.fix}"


def test_seconds():
    parse = seconds("fix it.")
    assert parse("1.5") == 1.5 and parse("0") == 0.0
    for bad in ("soon", "nan", "inf", "-1"):
        assert _refusal(parse, bad) == "is not a number of seconds; fix it.", bad
    assert seconds("fix it.", minimum=None)("-2") == -2.0
    assert seconds("fix it.", minimum=None, finite=False)("inf") == math.inf
    assert _refusal(seconds("fix it.", finite=False), "soon") == "is not a number of seconds; fix it."
    assert _refusal(seconds("fix it.", positive=True), "0") == "is not a positive number of seconds; fix it."
    assert _refusal(seconds("fix it.", need="a number of seconds (0 turns it off)"), "x") == (
        "is not a number of seconds (0 turns it off); fix it.")
    assert math.isclose(seconds("fix it.", scale=0.001)("5"), 0.005)


def test_whole_numbers_bytes_and_positive_counts():
    assert whole("fix it.")("0") == 0
    assert _refusal(whole("fix it."), "-1") == "is not a whole number >= 0; fix it."
    assert _refusal(whole("fix it."), "1.5") == "is not a whole number >= 0; fix it."
    assert whole("fix it.", minimum=None)("-3") == -3
    assert byte_count("fix it.")("1024") == 1024
    assert _refusal(byte_count("fix it."), "1 KB") == "is not a number of bytes; fix it."
    assert positive("fix it.")("1") == 1
    assert integer("fix it.")("-7") == -7
    assert _refusal(integer("fix it."), "seven") == "is not a whole number; fix it."
    assert _refusal(positive("fix it."), "0") == "is not a whole number above 0; fix it."
    assert _refusal(positive("fix it.", need="a whole number of files above 0"), "x") == (
        "is not a whole number of files above 0; fix it.")


def test_a_number_under_its_minimum_may_have_a_sentence_of_its_own():
    parse = byte_count("set it to e.g. 64.", below="must be 0 or more bytes.")
    assert _refusal(parse, "64 MB") == "is not a number of bytes; set it to e.g. 64."
    with pytest.raises(Invalid) as caught:
        parse("-1")
    assert (str(caught.value), caught.value.shown) == ("must be 0 or more bytes.", "-1")
    milliseconds = seconds("fix it.", need="a number of milliseconds", scale=0.001, below="must be 0 or more ms.")
    with pytest.raises(Invalid) as caught:
        milliseconds("-1.5")
    assert (str(caught.value), caught.value.shown) == ("must be 0 or more ms.", "-1.5")
    assert str(SettingError(KEEP_LOGS, "-1", caught.value)) == "SPARKHVD_KEEP_LOGS=-1.5 must be 0 or more ms."


def test_flags_take_horovods_words_in_any_case():
    parse = flag("fix it.")
    assert [parse(w) for w in ("1", "TRUE", "yes", " On ")] == [True] * 4
    assert [parse(w) for w in ("0", "false", "No", "OFF")] == [False] * 4
    assert _refusal(parse, "maybe") == "is not 1 or 0 (nor true/false, yes/no, on/off); fix it."
    assert _refusal(flag("fix it.", problem="is neither 1 nor 0"), "2") == "is neither 1 nor 0; fix it."


# ---- each refusal, as the user reads it ---------------------------------------------------------------------
# (the stall settings warn instead: tests/runner/policy/test_stall_reports.py; each setting another module owns is tested beside it)

REFUSALS = [
    (KEEP_FAILED_LOGS, "-1", "SPARKHVD_KEEP_FAILED_LOGS='-1' is not a whole number >= 0; set it to how many failed "
                             "runs' log folders to keep (default 20; 0 keeps none), or pass log_dir= to keep a run's "
                             "logs where you choose."),
    (COMMIT_MEMORY_BYTES, "1GB", "SPARKHVD_COMMIT_MEMORY_BYTES='1GB' is not a number of bytes; set it to e.g. "
                                 "268435456 (commits larger than it are kept in a file on the driver)."),
    (SHIP_SCRIPT_FOLDER, "maybe", "SPARKHVD_SHIP_SCRIPT_FOLDER='maybe' is not 1 or 0 (nor true/false, yes/no, on/off); "
                                  "set it to 0 to ship the script alone (not the modules beside it), or unset it."),
    (SCRIPT_FOLDER_MAX_BYTES, "10MB", "SPARKHVD_SCRIPT_FOLDER_MAX_BYTES='10MB' is not a whole number of bytes above 0; "
                                     "set it to e.g. 50000000, or unset it for the default 10000000."),
    (SCRIPT_FOLDER_MAX_FILES, "0", "SPARKHVD_SCRIPT_FOLDER_MAX_FILES='0' is not a whole number of files above 0; set "
                                   "it to e.g. 5000, or unset it for the default 1000."),
    (HOROVOD_SPARK_START_TIMEOUT, "soon", "HOROVOD_SPARK_START_TIMEOUT='soon' is not a number of seconds; set it to "
                                          "e.g. 600, or pass start_timeout=."),
    (MAX_CONTROL_PAYLOAD, "0", "SPARKHVD_MAX_CONTROL_PAYLOAD='0' is not a number of bytes above 0; set it to e.g. "
                               "67108864 (64 MB), the same on every rank, or unset it."),
    (RANK, "first", "RANK='first' is not a whole number; the launcher (torchrun or mpirun) sets it to one; unset it "
                    "to run hvd.init() without one."),
]


@pytest.mark.parametrize(("setting", "raw", "message"), REFUSALS, ids=[r[0].name for r in REFUSALS])
def test_a_bad_value_is_refused_with_the_fix(setting, raw, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        setting.get({setting.name: raw})


def test_the_aliases_are_off_only_for_zero():
    assert [HOROVOD_ALIASES.get(env) for env in ({}, {"SPARKHVD_HOROVOD_ALIASES": " 0 "},
                                                 {"SPARKHVD_HOROVOD_ALIASES": "1"},
                                                 {"SPARKHVD_HOROVOD_ALIASES": "no"})] == [True, False, True, True]


# ---- nothing else reads a variable ------------------------------------------------------------------------

# Where code outside _common/settings.py may touch os.environ as a whole, and why. Everything else reads a
# variable with settings.X.get() (or .raw()) and writes one by settings.X.name.
WHOLE_ENVIRONMENT = {
    ("runner/_agent/env.py", "rank_env"): "the rank process starts from a copy of the agent's environment",
    ("runner/_warm/child.py", "become_rank"): "a forked rank takes on the environment its agent gave it",
    ("runner/_warm/client.py", "start_server"): "the warm process starts from a copy of the agent's environment",
    ("runner/_warm/key.py", "zygote_key"): "the warm process's key hashes the variables Python and native "
                                           "libraries read at start (a family of prefixes, not settings)",
    ("runner/_payload/mlflow.py", "tracking_env"): "every MLFLOW_* variable goes to the ranks (credentials, store options)",
    ("runner/_backends/java.py", "check_java"): "JAVA_HOME: `make check-java` runs this file alone, before sparkhvd is "
                                       "installed, so it cannot import the settings module",
    ("runner/_rank/lightning_nodes.py", "regroup"): "torchrun's variables, rewritten as one set for Lightning's view "
                                                     "(framework_env.py's NAMES, which are not sparkhvd's settings)",
}
_WRITES = {"setdefault", "pop"}  # os.environ.<these>(settings.X.name, ...)


def _environ_uses(path: Path):
    """``(function, line, how)`` for each use of os.environ / os.getenv in ``path`` that is not a write by a
    setting's name."""
    source = path.read_text()
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def by_name(key) -> bool:
        return isinstance(key, ast.Attribute) and key.attr == "name"

    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            continue
        parent = parents.get(node)
        if (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store) and by_name(parent.slice)) or (
                isinstance(parent, ast.Attribute) and parent.attr in _WRITES
                and isinstance(parents.get(parent), ast.Call) and by_name(parents[parent].args[0])):
            continue
        function, up = None, node
        while up in parents and function is None:
            up = parents[up]
            if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function = up.name
        yield function, node.lineno, ast.get_source_segment(source, parent or node)


def test_no_module_but_settings_reads_an_environment_variable():
    found = []
    for folder in ("runner", "collective", "data", "_common", "ml", "."):
        paths = (ROOT / folder).glob("*.py") if folder == "." else (ROOT / folder).rglob("*.py")
        for path in sorted(paths):
            where = path.relative_to(ROOT).as_posix()
            if where == "_common/settings.py":
                continue
            found += [f"{where}:{line} ({function}): {how}" for function, line, how in _environ_uses(path)
                      if (where, function) not in WHOLE_ENVIRONMENT]
    assert found == [], ("read these variables through _common/settings.py (settings.X.get(), and write them by "
                         "settings.X.name), or add the function to WHOLE_ENVIRONMENT with the reason:\n"
                         + "\n".join(found))


def test_every_whole_environment_exception_is_still_there():
    for where, function in WHOLE_ENVIRONMENT:
        assert [f for f, _, _ in _environ_uses(ROOT / where) if f == function], (where, function)

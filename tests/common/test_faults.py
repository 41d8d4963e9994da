"""One fault grammar (``common/faults.py``): the environment form and the config keys give the
same ``Fault`` objects; the deprecated positional forms parse to them too; a bad spec is one
line naming the variable; a slowdown never logs the fatal event."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_nutp.common.events import read_events
from nemo_nutp.common.faults import FATAL_EVENT, SLOW_EVENT, Fault, Faults, parse
from nemo_nutp.config import load_config

# (deprecated positional spec, variable, the same faults in the one grammar, the faults)
OLD_AND_NEW = [
    ("kill:1:5", "NUTP_FAULT", "kill:rank=1:step=5", [Fault("kill", 1, 5)]),
    ("hang:5:3", "NUTP_FAULT", "hang:step=3:rank=5", [Fault("hang", 5, 3)]),
    ("save_crash:1:2", "NUTP_FAULT", "save_crash:rank=1:step=2", [Fault("save_crash", 1, 2)]),
    ("slow:3:2.5", "NUTP_FAULT", "slow:rank=3:factor=2.5", [Fault("slow", 3, 0, factor=2.5)]),
    ("slow:1:4:3", "NUTP_FAULT", "slow:rank=1:factor=4:step=3",
     [Fault("slow", 1, 3, factor=4.0)]),
    ("kill:3:4:vote,hang:0:0:relayout:2", "NUTP_LIVE_FAULT",
     "kill:rank=3:step=4:phase=vote,hang:rank=0:step=0:phase=relayout:gen=2",
     [Fault("kill", 3, 4, "vote"), Fault("hang", 0, 0, "relayout", 2)]),
    ("kill:1:1:forward:0,kill:4:0:relayout:1", "NUTP_LIVE_FAULT",
     "kill:rank=1:step=1:phase=forward:gen=0, kill:rank=4:phase=relayout:gen=1",
     [Fault("kill", 1, 1, "forward"), Fault("kill", 4, 0, "relayout", 1)]),
]


@pytest.mark.parametrize(("old", "var", "new", "faults"), OLD_AND_NEW)
def test_old_and_new_forms_give_equal_faults(old: str, var: str, new: str,
                                             faults: list[Fault],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(new) == faults
    assert capsys.readouterr().err == ""  # the one grammar: no warning
    assert parse(old, name=var) == faults
    # the config keys give the same objects
    entries = ",".join("{" + ",".join(f"{k}:{v}" for k, v in vars(f).items()
                                      if v is not None and not (k == "factor" and v == 1.0))
                       + "}" for f in faults)
    cfg = load_config([f"recovery.faults=[{entries}]",
                       "recovery.mode=live" if faults[0].phase else "recovery.mode=restart"])
    from nemo_nutp.common.faults import configured

    assert configured(cfg.recovery) == faults


def test_deprecated_form_warns_once_per_variable() -> None:
    code = ("from nemo_nutp.common.faults import parse\n"
            "parse('kill:1:5'); parse('hang:2:3'); parse('kill:1:2:vote', name='NUTP_LIVE_FAULT')")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ}).stderr.strip().splitlines()
    assert len(err) == 2 and all("deprecated" in line for line in err), err
    assert err[0].startswith("warning: NUTP_FAULT=") and "NUTP_LIVE_FAULT=" in err[1]


@pytest.mark.parametrize("bad", [
    "slow:1", "slow:1:0.5", "slow:x:3", "slow:1:3:4:5", "kill:1:2.5", "melt:1:2", "kill",
    "kill:step=2", "kill:rank=1:step=2:phase=lunch", "kill:rank=-1", "kill:rank=1:rnk=2",
    "kill:rank=1:rank=2", "slow:rank=1:factor=0.5", "slow:rank=1:step=4:until=4",
    "kill:rank=1:factor=2", "kill:rank=1:until=3", "save_crash:rank=1:phase=vote",
    "kill:rank=1:gen=1", "kill:rank=1:2", ",", "kill:rank=1:step=x"])
def test_bad_spec_is_one_line_naming_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^NUTP_FAULT=") as e:
        parse(bad)
    assert "\n" not in str(e.value)


def test_bad_config_names_the_key() -> None:
    for over, key in ((["recovery.fault.kind=melt"], r"recovery\.fault\.kind='melt'"),
                      (["recovery.fault.kind=slow", "recovery.fault.factor=0.5"],
                       r"recovery\.fault\.factor=0\.5"),
                      (["recovery.faults=[{kind:kill,rank:1},{kind:hang,rank:2,gen:1}]"],
                       r"recovery\.faults\[1\]\.gen=1")):
        with pytest.raises(ValueError, match="^" + key):
            load_config(over)
    # the single mapping of today keeps working, and adds to the list
    cfg = load_config(["recovery.fault.kind=kill", "recovery.fault.rank=1",
                       "recovery.fault.step=5", "recovery.faults=[{kind:slow,rank:0,factor:2}]"])
    from nemo_nutp.common.faults import configured

    assert configured(cfg.recovery) == [Fault("kill", 1, 5), Fault("slow", 0, 0, factor=2.0)]


def test_env_wins_and_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(["recovery.fault.kind=kill", "recovery.fault.rank=1"])
    for var in ("NUTP_FAULT", "NUTP_LIVE_FAULT", "NUTP_ATTEMPT"):
        monkeypatch.delenv(var, raising=False)
    f = Faults.from_env_or_config(cfg)
    assert f is not None and f.faults == (Fault("kill", 1, 0),)
    monkeypatch.setenv("NUTP_FAULT", "hang:rank=2:step=3")
    monkeypatch.setenv("NUTP_LIVE_FAULT", "kill:0:1:vote")
    f = Faults.from_env_or_config(cfg)
    assert f is not None and f.faults == (Fault("hang", 2, 3), Fault("kill", 0, 1, "vote"))
    monkeypatch.setenv("NUTP_ATTEMPT", "1")
    assert Faults.from_env_or_config(cfg) is None
    monkeypatch.setenv("NUTP_ATTEMPT", "0")
    assert Faults.from_env_or_config(None) is not None
    monkeypatch.delenv("NUTP_FAULT")
    monkeypatch.delenv("NUTP_LIVE_FAULT")
    assert Faults.from_env_or_config(load_config([])) is None


def test_a_fault_names_its_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attempt``: the restart attempt a fault fires in (default 0), so one job can inject a
    fault after a restart (tests/launch/test_slurm_faults.py: a straggler in attempt 2); from
    the config too; a bad value is one line naming the field."""
    for var in ("NUTP_FAULT", "NUTP_LIVE_FAULT", "NUTP_ATTEMPT", "NUTP_REQUEUED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NUTP_FAULT", "hang:rank=3:step=2,slow:rank=1:factor=4:attempt=2")
    hang, slow = Fault("hang", 3, 2), Fault("slow", 1, 0, factor=4.0, attempt=2)
    assert parse(os.environ["NUTP_FAULT"]) == [hang, slow]
    for attempt, want in (("0", (hang,)), ("1", None), ("2", (slow,))):
        monkeypatch.setenv("NUTP_ATTEMPT", attempt)
        f = Faults.from_env_or_config(None)
        assert (f.faults if f is not None else None) == want, attempt
    monkeypatch.delenv("NUTP_FAULT")
    cfg = load_config(["recovery.fault.kind=kill", "recovery.fault.rank=1",
                       "recovery.fault.attempt=2"])
    f = Faults.from_env_or_config(cfg)
    assert f is not None and f.faults == (Fault("kill", 1, 0, attempt=2),)
    with pytest.raises(ValueError, match=r"^NUTP_FAULT='kill:rank=1:attempt=-1': .*"
                                         r"attempt=-1: must be an integer >= 0"):
        parse("kill:rank=1:attempt=-1")
    with pytest.raises(ValueError, match=r"recovery\.fault\.attempt=-1: must be an integer"):
        load_config(["recovery.fault.kind=kill", "recovery.fault.attempt=-1"])


def test_slowdown_is_logged_apart_and_never_fatal(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow fault (alone, or beside fatal faults of other ranks/steps) logs only
    ``SLOW_EVENT`` at its first step and acts through ``slow_factor``: this process lives."""
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("NUTP_EVENTS", str(events))
    faults = Faults(parse("slow:rank=1:factor=3:step=2:until=4,slow:rank=0:factor=2,"
                          "kill:rank=2:step=2,save_crash:rank=3:step=0,kill:rank=1:step=2:"
                          "phase=vote"))
    for step in range(6):
        faults.at_step(1, step)
        faults.in_save(1, step)
        faults.at_step(0, step)
    assert [faults.slow_factor(1, s) for s in range(6)] == [1.0, 1.0, 3.0, 3.0, 1.0, 1.0]
    assert faults.slow_factor(0, 0) == 2.0 and faults.slow_factor(2, 3) == 1.0
    ev = read_events(events)
    assert [(e["event"], e["rank"], e["step"]) for e in ev] == \
        [(SLOW_EVENT, 0, 0), (SLOW_EVENT, 1, 2)]
    assert FATAL_EVENT not in {e["event"] for e in ev} and FATAL_EVENT != SLOW_EVENT


def test_fatal_fault_logs_the_fatal_event(tmp_path: Path) -> None:
    """The counterpart: a kill logs ``FATAL_EVENT`` and dies (SIGKILL), a phase fault once."""
    events = tmp_path / "events.jsonl"
    code = ("from nemo_nutp.common.faults import Faults, parse\n"
            "f = Faults(parse('kill:rank=0:step=1:phase=vote:gen=1,kill:rank=0:step=3'))\n"
            "f.at_step(0, 2); f.fire('vote', rank=0, step=1, gen=0)\n"
            "f.at_step(0, 3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "NUTP_EVENTS": str(events)})
    assert r.returncode == -9, r.stderr
    assert [(e["event"], e["kind"], e["step"]) for e in read_events(events)] == \
        [(FATAL_EVENT, "kill", 3)]

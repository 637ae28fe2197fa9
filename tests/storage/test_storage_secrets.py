"""A storage password holding ``@ : / # % ?``, written in the URL, put in by ``${NAME}`` or
inside a whole ``${DATABASE_URL}``, reaches the database whole, and no part of it (no run of 3
of its characters, as written or percent-encoded) is printed or written anywhere, whatever
fails: an unreachable host or port, a wrong password, or nothing at all."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
from _postgres import free_port
from sweep.test_pg_storage import TOY_SWEEP

from hfsweep.cli import main
from hfsweep.storage.db_url import for_driver, mask, scrub, shown

#: passwords no hfsweep message or file name holds any 3 characters of
PASSWORDS = {
    "at": "Qz@Wk",
    "colon": "Qz:Wk@Jy",
    "slash": "Qz/Wk/Jy@Vx",
    "hash": "Qz#Wk#Jy",
    "percent": "Qz%Wk%Jy",
    "question": "Qz?Wk@Jy",
    "braces": "Qz{Wk}Jy",  # Optuna formats the URL with str.format
    "long": "Qz@Wk:Jy/Vx#Rm%Tp?Hn{Gb}" * 3,
}
FORMS = ["raw", "name", "url"]
_VAR, _URL_VAR = "HFSWEEP_TEST_SECRET_PW", "HFSWEEP_TEST_SECRET_URL"


def _written(
    monkeypatch: pytest.MonkeyPatch, form: str, user: str, password: str, where: str
) -> str:
    """The storage URL of the sweep file for ``user:password@where`` in ``form``: the password
    written in it, put in by ``${NAME}``, or the whole URL from a variable."""
    monkeypatch.setenv(_VAR, password)
    monkeypatch.setenv(_URL_VAR, f"postgresql://{user}:{password}@{where}")
    return {
        "raw": f"postgresql://{user}:{password}@{where}",
        "name": f"postgresql://{user}:${{{_VAR}}}@{where}",
        "url": f"${{{_URL_VAR}}}",
    }[form]


def _leaks(password: str, text: str) -> list[str]:
    """The runs of 3 characters of ``password`` (or of its percent-encoded form) in ``text``."""
    forms = {password, quote(password, safe="")}
    return sorted({f[i : i + 3] for f in forms for i in range(len(f) - 2)} & _grams(text))


def _grams(text: str) -> set[str]:
    return {text[i : i + 3] for i in range(len(text) - 2)}


def _everything(capfd: pytest.CaptureFixture[str], folder: Path) -> str:
    """What was printed, and every file under ``folder`` but the sweep file (which holds the
    password as the user wrote it) and images (whose bytes may hold any 3 characters)."""
    captured = capfd.readouterr()
    files = [
        p.read_bytes().decode("latin-1")
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "sweep.yaml" and p.suffix != ".png"
    ]
    return "\n".join([captured.out, captured.err, *files])


# ---------------------------------------------------------------------------- the URL
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("password", list(PASSWORDS.values()), ids=list(PASSWORDS))
def test_the_driver_gets_the_whole_password_and_messages_none_of_it(
    monkeypatch: pytest.MonkeyPatch, password: str, form: str
) -> None:
    from sqlalchemy.engine import make_url

    url = _written(monkeypatch, form, "me", password, "127.0.0.1:5432/optuna?sslmode=disable")
    parsed = make_url(for_driver(url))
    assert (parsed.username, parsed.password) == ("me", password)
    assert (parsed.host, parsed.port, parsed.database) == ("127.0.0.1", 5432, "optuna")
    assert parsed.query == {"sslmode": "disable"}
    assert shown(url) == "postgresql://me:***@127.0.0.1:5432/optuna?sslmode=disable"
    assert _leaks(password, str(mask(url))) == []
    said = f"auth {password} / {quote(password, safe='')} / {unquote(password)} failed"
    assert _leaks(password, scrub(said, url)) == []
    tail = password[-6:]  # a parser that quoted part of it
    assert tail not in scrub(f"no host {tail!r}", url)


def test_the_config_repr_holds_no_password() -> None:
    from sweep._toy import sweep_config

    from hfsweep.config import parse_sweep

    password = PASSWORDS["long"]
    config = parse_sweep({**sweep_config("run"), "storage": f"postgresql://me:{password}@db/x"})
    assert _leaks(password, repr(config)) == []


def test_a_written_percent_escape_is_still_one() -> None:
    """SQLAlchemy always decoded ``%40`` in a password written in the URL; it still does, and
    a ``${NAME}`` value's ``%`` is taken literally."""
    from sqlalchemy.engine import make_url

    assert make_url(for_driver("postgresql://me:a%40b@db/x")).password == "a@b"
    env = {"PW": "a%40b"}
    assert make_url(for_driver("postgresql://me:${PW}@db/x", env)).password == "a%40b"


# ---------------------------------------------------------------------------- unreachable
@pytest.mark.parametrize("where", ["port", "host"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("password", list(PASSWORDS.values()), ids=list(PASSWORDS))
def test_an_unreachable_server_is_refused_without_any_of_the_password(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    password: str,
    form: str,
    where: str,
) -> None:
    pytest.importorskip("psycopg2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    server = "127.0.0.1:1" if where == "port" else f"127.0.0.2:{free_port()}"
    url = _written(monkeypatch, form, "me", password, f"{server}/optuna")
    Path("sweep.yaml").write_text(TOY_SWEEP + f"storage: '{url}'\n", encoding="utf-8")
    assert main(["validate", "sweep.yaml"]) == 2
    err = capfd.readouterr().err
    assert "Connection refused" in err and f"me:***@{server}/optuna" in err, err
    assert main(["run", "sweep.yaml"]) == 2
    assert _leaks(password, err + _everything(capfd, tmp_path)) == []


# ---------------------------------------------------------------------------- a real server
def _role(server: Any, password: str) -> str:
    """A new superuser of ``server`` whose password is ``password``; returns its name."""
    import psycopg2

    name = "r_" + uuid.uuid4().hex[:10]
    conn = psycopg2.connect(server.url())
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE ROLE "{name}" LOGIN SUPERUSER PASSWORD %s', (password,))
    finally:
        conn.close()
    return name


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("password", list(PASSWORDS.values()), ids=list(PASSWORDS))
def test_a_real_database_takes_the_password_and_refuses_a_wrong_one_unshown(
    postgres: str,
    postgres_server_shared: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    password: str,
    form: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    user = _role(postgres_server_shared, password)
    where = postgres.rsplit("@", 1)[1]
    url = _written(monkeypatch, form, user, password, where)
    Path("sweep.yaml").write_text(TOY_SWEEP + f"storage: '{url}'\n", encoding="utf-8")
    assert main(["validate", "sweep.yaml"]) == 0, capfd.readouterr().err
    assert _leaks(password, _everything(capfd, tmp_path)) == []

    wrong = _written(monkeypatch, form, user, password[::-1], where)
    Path("sweep.yaml").write_text(TOY_SWEEP + f"storage: '{wrong}'\n", encoding="utf-8")
    assert main(["validate", "sweep.yaml"]) == 2
    err = capfd.readouterr().err
    assert f'password authentication failed for user "{user}"' in err, err
    assert _leaks(password, err) == [] and _leaks(password[::-1], err) == []


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_a_sweep_resume_and_report_with_such_a_password_show_none_of_it(
    postgres: str,
    postgres_server_shared: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    form: str,
) -> None:
    password = PASSWORDS["long"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    user = _role(postgres_server_shared, password)
    url = _written(monkeypatch, form, user, password, postgres.rsplit("@", 1)[1])
    Path("sweep.yaml").write_text(TOY_SWEEP + f"storage: '{url}'\n", encoding="utf-8")
    assert main(["run", "sweep.yaml"]) == 0, capfd.readouterr().err
    assert main(["run", "sweep.yaml", "--resume"]) == 0, capfd.readouterr().err
    if form == "raw":  # sweep.json keeps no password: the driver takes it from PGPASSWORD
        monkeypatch.setenv("PGPASSWORD", password)
    assert main(["report", "runs/sweep"]) == 0, capfd.readouterr().err
    out = _everything(capfd, tmp_path)
    assert "completed" in out and (tmp_path / "runs" / "sweep" / "sweep.log").is_file()
    assert _leaks(password, out) == []

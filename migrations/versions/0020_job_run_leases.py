"""Job runs with an owner and a lease (``job_runs.owner``, ``lease_expires_at``, ``attempt``).

A slot's claim was a row ``running`` with nobody's name on it: a process killed mid-run (SIGKILL after the grace
period, an OOM kill) left it ``running`` for good, the slot could never run again (the day's retrain was lost), and
``/metrics`` ignored unfinished rows, so no alert saw it. Each claim now names its process (``host:pid:token``) and
holds a lease that the running process extends (:mod:`forecaster.jobs.runs`); a run whose lease ran out, or whose
process is known to be gone, is ``abandoned``, its slot can be claimed again (``attempt`` counts the claims) and
``/metrics`` reports it.

``job_runs_running`` indexes the claims still running (a handful), which every run reads under its job's lock.

Rows running when this migration runs were claimed without a lease (by the processes being replaced, or by ones
that died): they get a day from their start, and so does a claim inserted by a process of the previous version
(the column's default), after which they count as abandoned.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-08
"""

from alembic import op
import sqlalchemy as sa

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job_runs", sa.Column("owner", sa.String(255)))
    op.add_column("job_runs", sa.Column("lease_expires_at", sa.DateTime(timezone=True)))
    op.add_column("job_runs", sa.Column("attempt", sa.Integer, nullable=False, server_default="1"))
    op.execute("CREATE INDEX IF NOT EXISTS job_runs_running ON job_runs (job_name, slot) WHERE status = 'running'")
    op.execute("UPDATE job_runs SET lease_expires_at = started_at + interval '1 day' WHERE status = 'running'")
    op.alter_column("job_runs", "lease_expires_at", server_default=sa.text("now() + interval '1 day'"))


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS job_runs_running")
    op.drop_column("job_runs", "attempt")
    op.drop_column("job_runs", "lease_expires_at")
    op.drop_column("job_runs", "owner")

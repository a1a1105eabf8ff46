-- pgdef schema, version 1. Applied once, in one transaction, by aotattn.pgdef.schema.migrate.
-- Later changes are new files (0002_*.sql ...); a released file is never edited.

-- One row per task. A task is (app, subcategory, pool, task_key): dispatching the same key
-- to the same category and pool again inserts nothing. state moves queued -> running -> done | failed | cancelled; running means
-- that lease_owner (a worker id or "batch:<id>") holds a lease until lease_expires_at.
CREATE TABLE pgdef_task (
    id               bigserial PRIMARY KEY,
    app              text NOT NULL CHECK (app ~ '^[a-z][a-z0-9_.-]*$'),
    subcategory      text NOT NULL DEFAULT '' CHECK (subcategory ~ '^([a-z0-9_.-]+)?$'),
    category         text GENERATED ALWAYS AS (
                         CASE WHEN subcategory = '' THEN app ELSE app || ',' || subcategory END) STORED,
    pool             text NOT NULL CHECK (pool ~ '^[A-Za-z0-9_.-]+$'),
    task_key         text NOT NULL CHECK (task_key <> ''),
    priority         integer NOT NULL DEFAULT 0,
    payload          jsonb NOT NULL CHECK (jsonb_typeof(payload) = 'object'),
    state            text NOT NULL DEFAULT 'queued'
                         CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    lease_owner      text,
    lease_expires_at timestamptz,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    CONSTRAINT pgdef_task_key_unique UNIQUE (app, subcategory, pool, task_key),
    -- A lease exists exactly while the task runs.
    CONSTRAINT pgdef_task_lease_iff_running CHECK (
        (state = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);

-- The claim query walks this index: queued tasks of one pool, best priority first, oldest first.
CREATE INDEX pgdef_task_claim_idx ON pgdef_task (pool, priority DESC, id) WHERE state = 'queued';
-- Expired-lease scans and per-owner lease renewal.
CREATE INDEX pgdef_task_lease_idx ON pgdef_task (lease_expires_at) WHERE state = 'running';
CREATE INDEX pgdef_task_owner_idx ON pgdef_task (lease_owner) WHERE state = 'running';
CREATE INDEX pgdef_task_category_idx ON pgdef_task (app, subcategory, state);

-- The accepted result. The primary key is the guarantee: at most one row per task.
CREATE TABLE pgdef_result (
    task_id    bigint PRIMARY KEY REFERENCES pgdef_task (id) ON DELETE CASCADE,
    output     jsonb NOT NULL,
    worker_id  text NOT NULL,
    attempt    integer NOT NULL,
    elapsed_s  double precision NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX pgdef_result_worker_idx ON pgdef_result (worker_id);

-- The selection every command takes: --category app[,subcategory] and --pool, NULL meaning any.
CREATE FUNCTION pgdef_selected(task_app text, task_sub text, task_pool text,
                               want_app text, want_sub text, want_pool text) RETURNS boolean
    LANGUAGE sql IMMUTABLE AS $$
    SELECT (want_app IS NULL OR (task_app = want_app AND (want_sub IS NULL OR task_sub = want_sub)))
       AND (want_pool IS NULL OR task_pool = want_pool)
$$;

-- Workers announce themselves and heartbeat here; status reads it.
CREATE TABLE pgdef_worker (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    pool         text NOT NULL,
    categories   text[] NOT NULL,
    gpu          integer,
    lease_s      double precision NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stopped_at   timestamptz
);

-- Offline batches: tasks checked out into a file under one long lease (owner "batch:<id>").
CREATE TABLE pgdef_batch (
    id               text PRIMARY KEY,
    pool             text NOT NULL,
    host             text NOT NULL,
    n_tasks          integer NOT NULL,
    task_ids         bigint[] NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    checked_in_at    timestamptz,
    n_accepted       integer NOT NULL DEFAULT 0
);

-- What happened to a task besides claim and completion: errors, expired leases, retries,
-- cancellations, results that arrived after another was accepted.
CREATE TABLE pgdef_event (
    id      bigserial PRIMARY KEY,
    task_id bigint NOT NULL REFERENCES pgdef_task (id) ON DELETE CASCADE,
    at      timestamptz NOT NULL DEFAULT now(),
    event   text NOT NULL CHECK (event IN ('error', 'expired', 'retry', 'cancel', 'late_result', 'released')),
    owner   text,
    attempt integer,
    detail  text
);
CREATE INDEX pgdef_event_task_idx ON pgdef_event (task_id);

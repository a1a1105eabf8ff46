-- Every SQL statement pgdef sends, by name. aotattn.pgdef.queries loads this file into a dict.
-- Format: a line "-- name: NAME" starts a query; the "--" lines after it describe it; the query
-- runs to the next "-- name:" line. Parameters are %(name)s placeholders, never formatted in.
-- Each statement is atomic on its own (autocommit): multi-step changes are data-modifying CTEs.

-- name: create_migration_table
-- The table that records which schema migrations (aotattn/pgdef/migrations/*.sql) are applied.
CREATE TABLE IF NOT EXISTS pgdef_migration (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: lock_migrations
-- Serialises concurrent migrate() calls until the end of the transaction.
SELECT pg_advisory_xact_lock(%(lock_id)s::bigint)

-- name: applied_migrations
SELECT version, name FROM pgdef_migration ORDER BY version

-- name: record_migration
INSERT INTO pgdef_migration (version, name) VALUES (%(version)s, %(name)s)

-- name: schema_present
SELECT to_regclass('pgdef_migration') IS NOT NULL AS present

-- name: schema_version
SELECT coalesce(max(version), 0) AS version FROM pgdef_migration

-- name: lock_dispatch
-- Serialises concurrent dispatches to one category and pool until the end of the transaction:
-- two dispatchers inserting the same keys in different orders would each wait for a row the
-- other inserted and not committed, a deadlock. The two-key form does not meet the migration lock.
SELECT pg_advisory_xact_lock(%(lock_class)s::integer, hashtext(%(category)s || ' ' || %(pool)s))

-- name: dispatch
-- Inserts tasks from parallel arrays; a task whose (app, subcategory, pool, task_key) exists is skipped.
INSERT INTO pgdef_task (app, subcategory, pool, task_key, priority, payload, max_attempts)
SELECT * FROM unnest(%(apps)s::text[], %(subcategories)s::text[], %(pools)s::text[], %(keys)s::text[],
                     %(priorities)s::integer[], %(payloads)s::jsonb[], %(max_attempts)s::integer[])
ON CONFLICT (app, subcategory, pool, task_key) DO NOTHING
RETURNING id

-- name: claim
-- Takes up to limit queued tasks of one pool and the given categories, best priority then
-- oldest first; rows another claimer has locked are skipped, not waited for. Each claim is
-- an attempt. Also used by checkout, with owner "batch:<id>" and a long lease, and there
-- optionally only among task_ids (a batch its caller sized from the tasks it listed).
WITH candidate AS (
    SELECT id
      FROM pgdef_task
     WHERE state = 'queued' AND pool = %(pool)s AND category = ANY(%(categories)s::text[])
       AND (%(task_ids)s::bigint[] IS NULL OR id = ANY(%(task_ids)s::bigint[]))
     ORDER BY priority DESC, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE pgdef_task AS t
   SET state = 'running',
       attempts = t.attempts + 1,
       lease_owner = %(owner)s,
       lease_expires_at = now() + make_interval(secs => %(lease_s)s::float8),
       started_at = now()
  FROM candidate
 WHERE t.id = candidate.id
RETURNING t.id, t.app, t.subcategory, t.pool, t.task_key, t.priority, t.payload, t.attempts,
          t.max_attempts, t.lease_expires_at

-- name: renew_leases
-- The heartbeat: marks the worker alive and extends the leases of the tasks it knows it holds.
-- Listing the ids (not "all my tasks") lets a claim whose reply was lost expire on its own.
WITH beat AS (
    UPDATE pgdef_worker SET heartbeat_at = now() WHERE id = %(owner)s
)
UPDATE pgdef_task
   SET lease_expires_at = now() + make_interval(secs => %(lease_s)s::float8)
 WHERE state = 'running' AND lease_owner = %(owner)s AND id = ANY(%(task_ids)s::bigint[])
RETURNING id

-- name: complete
-- Accepts a result and marks its task done, in one statement: the first result of a task that
-- is not done or cancelled wins, whoever holds the lease; any later one inserts nothing.
WITH task AS (
    SELECT id
      FROM pgdef_task
     WHERE id = %(task_id)s AND state IN ('queued', 'running', 'failed')
       FOR UPDATE
), accepted AS (
    INSERT INTO pgdef_result (task_id, output, worker_id, attempt, elapsed_s)
    SELECT id, %(output)s::jsonb, %(worker_id)s, %(attempt)s, %(elapsed_s)s::float8 FROM task
    ON CONFLICT (task_id) DO NOTHING
    RETURNING task_id
)
UPDATE pgdef_task AS t
   SET state = 'done', error = NULL, finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
  FROM accepted
 WHERE t.id = accepted.task_id
RETURNING t.id

-- name: record_late_result
-- Notes a result that was not accepted (the task was already done or cancelled).
INSERT INTO pgdef_event (task_id, event, owner, attempt, detail)
SELECT id, 'late_result', %(owner)s, %(attempt)s, 'not accepted: task was ' || state
  FROM pgdef_task WHERE id = %(task_id)s

-- name: fail
-- Records a failed attempt by the lease holder. The task goes back to the queue unless the
-- failure is permanent (a malformed payload) or it has used its last attempt.
WITH failed AS (
    UPDATE pgdef_task
       SET state = CASE WHEN %(permanent)s::boolean OR attempts >= max_attempts THEN 'failed' ELSE 'queued' END,
           finished_at = CASE WHEN %(permanent)s::boolean OR attempts >= max_attempts THEN now() END,
           error = %(error)s, lease_owner = NULL, lease_expires_at = NULL
     WHERE id = %(task_id)s AND state = 'running' AND lease_owner = %(owner)s AND attempts = %(attempt)s
 RETURNING id, state, attempts
), logged AS (
    INSERT INTO pgdef_event (task_id, event, owner, attempt, detail)
    SELECT id, 'error', %(owner)s, attempts, %(error)s FROM failed
)
SELECT state FROM failed

-- name: requeue_expired
-- Returns every task whose lease has expired to the queue (or to failed, after its last
-- attempt). Rows being changed by someone else right now are left for the next pass.
WITH expired AS (
    SELECT id, lease_owner
      FROM pgdef_task
     WHERE state = 'running' AND lease_expires_at < now()
       FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE pgdef_task AS t
       SET state = CASE WHEN t.attempts >= t.max_attempts THEN 'failed' ELSE 'queued' END,
           finished_at = CASE WHEN t.attempts >= t.max_attempts THEN now() END,
           error = 'lease of ' || expired.lease_owner || ' expired during attempt ' || t.attempts,
           lease_owner = NULL, lease_expires_at = NULL
      FROM expired
     WHERE t.id = expired.id
 RETURNING t.id, t.state, t.attempts, t.error, expired.lease_owner AS owner
), logged AS (
    INSERT INTO pgdef_event (task_id, event, owner, attempt, detail)
    SELECT id, 'expired', owner, attempts, error FROM requeued
)
SELECT id, state FROM requeued

-- name: release
-- Gives back tasks the owner claimed but never ran; the attempt is not counted.
WITH released AS (
    UPDATE pgdef_task
       SET state = 'queued', attempts = attempts - 1, lease_owner = NULL, lease_expires_at = NULL
     WHERE state = 'running' AND lease_owner = %(owner)s AND id = ANY(%(task_ids)s::bigint[])
 RETURNING id, attempts
), logged AS (
    INSERT INTO pgdef_event (task_id, event, owner, attempt)
    SELECT id, 'released', %(owner)s, attempts FROM released
)
SELECT id FROM released

-- name: open_count
-- Tasks of these categories and pool that are queued or running on a worker: while any is, an
-- idle worker that exits when idle keeps waiting (a running task may come back when its lease
-- expires). A task checked out in an offline batch ("batch:<id>") comes back by checkin: an
-- idle worker waited out the batch's lease (a day by default) for it.
SELECT count(*) AS n
  FROM pgdef_task
 WHERE pool = %(pool)s AND category = ANY(%(categories)s::text[])
   AND (state = 'queued' OR (state = 'running' AND lease_owner NOT LIKE 'batch:%%'))

-- name: register_worker
INSERT INTO pgdef_worker (id, host, pid, pool, categories, gpu, lease_s)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(pool)s, %(categories)s::text[], %(gpu)s, %(lease_s)s::float8)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), stopped_at = NULL

-- name: stop_worker
UPDATE pgdef_worker SET stopped_at = now() WHERE id = %(worker_id)s

-- name: retry
-- Re-queues failed (and, when asked, cancelled) tasks with a fresh count of attempts.
WITH retried AS (
    UPDATE pgdef_task
       SET state = 'queued', attempts = 0, error = NULL, finished_at = NULL
     WHERE state = ANY(%(states)s::text[])
       AND pgdef_selected(app, subcategory, pool, %(app)s, %(subcategory)s, %(pool)s)
       AND (%(task_ids)s::bigint[] IS NULL OR id = ANY(%(task_ids)s::bigint[]))
 RETURNING id
), logged AS (
    INSERT INTO pgdef_event (task_id, event) SELECT id, 'retry' FROM retried
)
SELECT count(*) AS n FROM retried

-- name: cancel
-- Cancels tasks that are not done; a running task's eventual result will not be accepted.
WITH cancelled AS (
    UPDATE pgdef_task
       SET state = 'cancelled', finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
     WHERE state IN ('queued', 'running', 'failed')
       AND pgdef_selected(app, subcategory, pool, %(app)s, %(subcategory)s, %(pool)s)
       AND (%(task_ids)s::bigint[] IS NULL OR id = ANY(%(task_ids)s::bigint[]))
 RETURNING id
), logged AS (
    INSERT INTO pgdef_event (task_id, event) SELECT id, 'cancel' FROM cancelled
)
SELECT count(*) AS n FROM cancelled

-- name: status_counts
-- Progress per category and pool; recent_done and recent_span_s give the completion rate.
SELECT category, pool,
       count(*) FILTER (WHERE state = 'queued') AS queued,
       count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'done') AS done,
       count(*) FILTER (WHERE state = 'failed') AS failed,
       count(*) FILTER (WHERE state = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE state = 'running' AND lease_expires_at < now()) AS expired,
       count(*) FILTER (WHERE state = 'done'
                          AND finished_at > now() - make_interval(secs => %(window_s)s::float8)) AS recent_done,
       extract(epoch FROM now() - min(finished_at) FILTER (
           WHERE state = 'done' AND finished_at > now() - make_interval(secs => %(window_s)s::float8)))::float8
           AS recent_span_s
  FROM pgdef_task
 WHERE pgdef_selected(app, subcategory, pool, %(app)s, %(subcategory)s, %(pool)s)
 GROUP BY category, pool
 ORDER BY category, pool

-- name: status_workers
-- Workers that have heartbeaten within their lease and not stopped.
SELECT w.id, w.host, w.pid, w.pool, w.gpu, w.categories, w.started_at,
       extract(epoch FROM now() - w.heartbeat_at)::float8 AS heartbeat_age_s,
       (SELECT count(*) FROM pgdef_task AS t WHERE t.state = 'running' AND t.lease_owner = w.id) AS holding,
       (SELECT count(*) FROM pgdef_result AS r WHERE r.worker_id = w.id) AS done
  FROM pgdef_worker AS w
 WHERE w.stopped_at IS NULL
   AND w.heartbeat_at > now() - make_interval(secs => w.lease_s)
   AND (%(pool)s::text IS NULL OR w.pool = %(pool)s)
 ORDER BY w.started_at, w.id

-- name: status_expired
-- Running tasks whose lease has run out and that no one has re-queued yet.
SELECT id, category, pool, lease_owner, attempts,
       extract(epoch FROM now() - lease_expires_at)::float8 AS expired_for_s
  FROM pgdef_task
 WHERE state = 'running' AND lease_expires_at < now()
   AND pgdef_selected(app, subcategory, pool, %(app)s, %(subcategory)s, %(pool)s)
 ORDER BY lease_expires_at
 LIMIT %(limit)s

-- name: status_failures
SELECT id, category, pool, task_key, attempts, error, finished_at
  FROM pgdef_task
 WHERE state = 'failed'
   AND pgdef_selected(app, subcategory, pool, %(app)s, %(subcategory)s, %(pool)s)
 ORDER BY finished_at DESC, id DESC
 LIMIT %(limit)s

-- name: status_batches
-- Offline batches not yet checked in.
SELECT b.id, b.pool, b.host, b.n_tasks, b.created_at, b.lease_expires_at,
       b.lease_expires_at < now() AS expired,
       (SELECT count(*) FROM pgdef_task AS t
         WHERE t.state = 'running' AND t.lease_owner = 'batch:' || b.id) AS holding
  FROM pgdef_batch AS b
 WHERE b.checked_in_at IS NULL AND (%(pool)s::text IS NULL OR b.pool = %(pool)s)
 ORDER BY b.created_at

-- name: results
-- Accepted results with their tasks, in task order.
SELECT t.id, t.app, t.subcategory, t.pool, t.task_key, t.payload, r.output, r.worker_id,
       r.attempt, r.elapsed_s, r.created_at
  FROM pgdef_task AS t
  JOIN pgdef_result AS r ON r.task_id = t.id
 WHERE pgdef_selected(t.app, t.subcategory, t.pool, %(app)s, %(subcategory)s, %(pool)s)
   AND (%(keys)s::text[] IS NULL OR t.task_key = ANY(%(keys)s::text[]))
 ORDER BY t.id

-- name: tasks
SELECT id, app, subcategory, pool, task_key, priority, payload, state, attempts, max_attempts,
       lease_owner, lease_expires_at, error
  FROM pgdef_task
 WHERE pgdef_selected(app, subcategory, pool, %(app)s, %(subcategory)s, %(pool)s)
   AND (%(states)s::text[] IS NULL OR state = ANY(%(states)s::text[]))
   AND (%(keys)s::text[] IS NULL OR task_key = ANY(%(keys)s::text[]))
 ORDER BY id

-- name: events
SELECT task_id, at, event, owner, attempt, detail
  FROM pgdef_event
 WHERE task_id = ANY(%(task_ids)s::bigint[])
 ORDER BY id

-- name: create_batch
-- Called in the checkout transaction after the claim, so now() is the claim's now().
INSERT INTO pgdef_batch (id, pool, host, n_tasks, task_ids, lease_expires_at)
VALUES (%(batch_id)s, %(pool)s, %(host)s, cardinality(%(task_ids)s::bigint[]), %(task_ids)s::bigint[],
        now() + make_interval(secs => %(lease_s)s::float8))
RETURNING lease_expires_at

-- name: drop_batch
-- A batch whose file could not be written: its tasks were released, nobody holds it.
DELETE FROM pgdef_batch WHERE id = %(batch_id)s AND checked_in_at IS NULL

-- name: batch
SELECT id, pool, host, n_tasks, task_ids, lease_expires_at, checked_in_at, n_accepted,
       lease_expires_at < now() AS expired
  FROM pgdef_batch
 WHERE id = %(batch_id)s

-- name: batch_held
-- The batch's tasks that still run under its lease, as the claim returned them (a checkout
-- whose reply was lost reads its tasks back with this).
SELECT id, app, subcategory, pool, task_key, priority, payload, attempts, max_attempts, lease_expires_at
  FROM pgdef_task
 WHERE state = 'running' AND lease_owner = %(owner)s
 ORDER BY id

-- name: finish_batch
UPDATE pgdef_batch
   SET checked_in_at = coalesce(checked_in_at, now()), n_accepted = n_accepted + %(n_accepted)s
 WHERE id = %(batch_id)s

-- name: database_exists
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = %(name)s) AS present

-- name: create_embedded_database
-- The embedded server's one database (aotattn.pgdef.embedded.DATABASE).
CREATE DATABASE pgdef

-- name: now
SELECT now() AS now

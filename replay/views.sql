-- Analyst views over the recorded log `events(stream, seq, ts_ns, subject, data)`.
-- Created by the recorder at start and by every reader when missing; documented in
-- docs/analysts.md. Rules: `data` is raw text and may be malformed JSON, so every view reads
-- it through `input_events.j` / `output_events.j` (NULL when not valid JSON, or when the
-- payload was not UTF-8: then `raw` holds its exact bytes and `data` only a readable
-- rendering, and the scheduler rejected it) and never fails on a bad row. Times are integer nanoseconds (`ts_ns`, the JetStream timestamp the scheduler
-- used); durations are milliseconds. Node, pool and proxy names are the subject's last token.
-- Batches: a proxy's `lb.req.batch.<proxy>` message holds its request events and heartbeats
-- in order (docs/wire.md, "Batched request events"); `input_events` unnests them, so a
-- batched event is a row as it would be alone (its own subject, family, key and payload) at
-- the batch's seq and ts_ns, with `event_index` its position in the batch (0 for a message
-- holding one event). Order events by (seq, event_index): several share a seq. Which kinds a
-- batch holds, the subject each has alone and whether its key is the batch's proxy come from
-- `fact_kinds` (the fact table, schemas/facts.py; replay/store.py creates it before these views).

CREATE OR REPLACE VIEW input_messages AS
SELECT seq, ts_ns, subject,
       regexp_extract(subject, '^(.*)\.[^.]+$', 1) AS family,
       split_part(subject, '.', -1) AS key,
       CASE WHEN raw IS NULL AND json_valid(data) THEN data::JSON END AS j,
       data, raw
FROM events WHERE stream = 'LB_EVENTS';

CREATE OR REPLACE VIEW input_events AS
SELECT seq, ts_ns, subject, family, key, j, data, raw, 0 AS event_index, NULL::VARCHAR AS batch_subject
FROM input_messages WHERE family IS DISTINCT FROM 'lb.req.batch'
UNION ALL
SELECT seq, ts_ns, family || '.' || key AS subject, family, key, j, j::VARCHAR AS data,
       NULL::BLOB AS raw, event_index, batch_subject
FROM (
    SELECT b.seq, b.ts_ns, b.batch_subject, b.j, b.event_index, f.family,
           CASE WHEN f.key = 'proxy' THEN b.proxy ELSE b.item_key END AS key
    FROM (
        SELECT seq, ts_ns, batch_subject, proxy, e->>0 AS kind, e->>1 AS item_key, e->2 AS j, event_index
        FROM (
            SELECT seq, ts_ns, subject AS batch_subject, key AS proxy,
                   unnest(CAST(j->'events' AS JSON[])) AS e,
                   generate_subscripts(CAST(j->'events' AS JSON[]), 1) - 1 AS event_index
            FROM input_messages
            WHERE family = 'lb.req.batch' AND json_type(j->'events') = 'ARRAY')
        WHERE json_type(e) = 'ARRAY') AS b
    JOIN fact_kinds f ON f.kind = b.kind AND f.batchable)
WHERE key IS NOT NULL;

CREATE OR REPLACE VIEW output_events AS
SELECT seq, ts_ns, subject,
       CASE WHEN raw IS NULL AND json_valid(data) THEN data::JSON END AS j,
       data, raw
FROM events WHERE stream = 'LB_OUT';

-- One row per (snapshot, node). A snapshot published twice (same pool and as_of_seq, e.g. by
-- two scheduler replicas outside the de-duplication window) counts once: the first published.
-- For long logs, the copies are found from each snapshot's pool and as_of_seq alone, and only
-- the kept snapshots are parsed, into the fields below (`from_json`, every field read as text
-- and then cast as `->>` would be), so no step holds every snapshot's whole JSON at once.
CREATE OR REPLACE VIEW snapshot_nodes AS
WITH heads AS (
    SELECT seq, from_json(data, '{"pool": "VARCHAR", "as_of_seq": "VARCHAR"}') AS h
    FROM events
    WHERE stream = 'LB_OUT' AND subject LIKE 'lb.out.snapshot.%' AND raw IS NULL AND json_valid(data)
), firsts AS (
    SELECT min(seq) AS seq FROM heads GROUP BY h.pool, h.as_of_seq
), snapshots AS (
    SELECT seq AS out_seq, s.pool AS pool, TRY_CAST(s.as_of_seq AS BIGINT) AS as_of_seq,
           TRY_CAST(s.tick AS BIGINT) AS tick, TRY_CAST(s.ts_ns AS BIGINT) AS ts_ns, s.nodes AS nodes
    FROM (SELECT seq, from_json(data, '{"pool": "VARCHAR", "as_of_seq": "VARCHAR", "tick": "VARCHAR",
              "ts_ns": "VARCHAR", "nodes": [{"node": "VARCHAR", "phase": "VARCHAR", "phase_reason": "VARCHAR",
              "phase_cause": "VARCHAR", "routable": "VARCHAR", "capacity": "VARCHAR", "effective_weight": "VARCHAR",
              "target_weight": "VARCHAR", "inflight": "VARCHAR", "load": {"slots": "VARCHAR"}}]}') AS s
          FROM events WHERE stream = 'LB_OUT' AND seq IN (SELECT seq FROM firsts))
)
SELECT s.out_seq, s.as_of_seq, s.tick, s.ts_ns, s.pool,
       n.node AS node, n.phase AS phase, n.phase_reason AS phase_reason, n.phase_cause AS phase_cause,
       TRY_CAST(n.routable AS BOOLEAN) AS routable,
       TRY_CAST(n.capacity AS BIGINT) AS capacity,
       TRY_CAST(n.effective_weight AS DOUBLE) AS effective_weight,
       TRY_CAST(n.target_weight AS DOUBLE) AS target_weight,
       TRY_CAST(n.inflight AS BIGINT) AS inflight,
       TRY_CAST(n.load.slots AS DOUBLE) AS believed_slots
FROM snapshots s, unnest(s.nodes) AS t(n);

CREATE OR REPLACE VIEW weights_over_time AS
SELECT ts_ns, tick, pool, node, phase, effective_weight, target_weight, inflight, capacity, routable, as_of_seq,
       believed_slots
FROM snapshot_nodes;

CREATE OR REPLACE VIEW phase_changes AS
SELECT seq AS out_seq, ts_ns AS recorded_ts_ns, TRY_CAST(j->>'as_of_seq' AS BIGINT) AS as_of_seq,
       j->>'node' AS node, coalesce(j->>'pool', 'default') AS pool,
       j->>'from' AS from_phase, j->>'to' AS to_phase, j->>'cause' AS cause, j->>'reason' AS reason
FROM output_events
WHERE subject LIKE 'lb.out.phase.%' AND j IS NOT NULL
QUALIFY row_number() OVER (PARTITION BY j->>'as_of_seq', j->>'node', j->>'to' ORDER BY seq) = 1;

-- One row per attempt: the first `lb.req.started` of an attempt id and its first later
-- `lb.req.finished`. A proxy retry or continuation k >= 1 of client request R uses attempt id
-- "R.k" (see services/proxy/events.py), so request_id = the attempt id before its first '.'.
-- outcome is NULL while the attempt is open (never finished). next_attempt names the attempt
-- that continued (outcome `continued`) or retried this one. error is text for people: no view
-- compares it.
-- started_index / finished_index: the events' positions in their batches (0 when unbatched).
-- status: the engine's HTTP status for this attempt (NULL when it never answered);
-- status_class: '2xx', '3xx', '4xx', '5xx', or 'none' (no answer), NULL while open.
-- role: a prefill/decode pair's leg, 'prefill' or 'decode' (NULL for a whole request). A pair is
-- one request of two attempts: R (prefill, completed, no next_attempt: not a retry) and R.1
-- (decode), whose outcome is the request's (docs/proxy.md, "Prefill/decode pairs").
-- cached_tokens: the prompt tokens the proxy's view predicted cached on the node at the pick
-- (lb.req.started's, with the proxy's --tokenizer; NULL when unknown, as for a retry).
-- stream: the client's answer is an SSE stream (lb.req.finished's; NULL for a log written before
-- the field); first_byte_ms: the first byte sent to the client, as recorded (the finished event's
-- ttft_ms); ttft_ms: the same for a streamed answer only, NULL for a whole answer (stream false),
-- whose first byte is its end, so a TTFT percentile never mixes the two (docs/analysts.md).
CREATE OR REPLACE VIEW attempts AS
WITH started AS (
    SELECT j->>'request_id' AS attempt_id, key AS node, coalesce(j->>'pool', 'default') AS pool,
           j->>'proxy' AS proxy, seq, ts_ns, TRY_CAST(j->>'snapshot_seq' AS BIGINT) AS snapshot_seq, event_index,
           j->>'role' AS role, TRY_CAST(j->>'cached_tokens' AS BIGINT) AS cached_tokens
    FROM input_events
    WHERE family = 'lb.req.started' AND j->>'request_id' IS NOT NULL
    QUALIFY row_number() OVER (PARTITION BY j->>'request_id' ORDER BY seq, event_index) = 1
), finished AS (
    SELECT j->>'request_id' AS attempt_id, seq, ts_ns, j->>'outcome' AS outcome, j->>'error' AS error,
           TRY_CAST(j->>'ttft_ms' AS DOUBLE) AS ttft_ms, TRY_CAST(j->>'duration_ms' AS DOUBLE) AS duration_ms,
           TRY_CAST(j->>'prompt_tokens' AS BIGINT) AS prompt_tokens,
           TRY_CAST(j->>'completion_tokens' AS BIGINT) AS completion_tokens, j->>'next_attempt' AS next_attempt,
           event_index, TRY_CAST(j->>'status' AS INTEGER) AS status, TRY_CAST(j->>'stream' AS BOOLEAN) AS stream
    FROM input_events
    WHERE family = 'lb.req.finished' AND j->>'request_id' IS NOT NULL
)
SELECT split_part(s.attempt_id, '.', 1) AS request_id, s.attempt_id, s.node, s.pool, s.proxy,
       s.seq AS started_seq, s.ts_ns AS started_ts_ns,
       f.seq AS finished_seq, f.ts_ns AS finished_ts_ns,
       f.outcome, CASE WHEN f.stream IS DISTINCT FROM false THEN f.ttft_ms END AS ttft_ms, f.duration_ms,
       s.snapshot_seq, f.error,
       f.prompt_tokens, f.completion_tokens, f.next_attempt,
       s.event_index AS started_index, f.event_index AS finished_index,
       f.status, CASE WHEN f.outcome IS NULL THEN NULL WHEN f.status IS NULL THEN 'none'
                      ELSE (f.status // 100)::VARCHAR || 'xx' END AS status_class,
       s.role, s.cached_tokens, f.stream, f.ttft_ms AS first_byte_ms
FROM started s
LEFT JOIN finished f ON f.attempt_id = s.attempt_id AND (f.seq, f.event_index) > (s.seq, s.event_index)
QUALIFY row_number() OVER (PARTITION BY s.attempt_id ORDER BY f.seq NULLS LAST, f.event_index) = 1;

-- One row per client request: started when its first attempt started; node, outcome, finish,
-- duration_ms (counted by the proxy from the request's arrival) and snapshot_seq are those of
-- its last attempt (a retried failure the client never saw, or a stream continued elsewhere,
-- is not the request's outcome), and so is status (the engine's HTTP status, NULL when none answered); ttft_ms is the earliest first byte of any attempt (a
-- continued stream's first byte came from the attempt that broke), NULL unless the answer was
-- streamed; stream: the client's answer was an SSE stream (any attempt's; NULL for a log written
-- before the field); continued counts the attempts continued on another node; cached_tokens is
-- its pick's prediction (only a first admission with the request's tokens has one).
CREATE OR REPLACE VIEW requests AS
WITH first_start AS (
    SELECT request_id, min(started_seq) AS started_seq, min(started_ts_ns) AS started_ts_ns, count(*) AS attempts,
           min(ttft_ms) AS ttft_ms, count(*) FILTER (WHERE outcome = 'continued') AS continued,
           max(cached_tokens) AS cached_tokens, bool_or(stream) AS stream
    FROM attempts GROUP BY request_id
), last_attempt AS (
    SELECT * FROM attempts
    QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY started_seq DESC, started_index DESC) = 1
)
SELECT l.request_id, l.node, l.pool, l.proxy, f.started_seq, f.started_ts_ns,
       l.finished_seq, l.finished_ts_ns, l.outcome, f.ttft_ms, l.duration_ms, l.snapshot_seq,
       f.attempts, l.started_seq AS last_attempt_seq, f.continued, l.started_index AS last_attempt_index,
       l.status, l.status_class, l.error, f.cached_tokens, f.stream
FROM first_start f JOIN last_attempt l USING (request_id);

-- Requests the proxy answered itself (lb.req.refused.<proxy>: 401, 400, 408, 413, 404, 429,
-- 503), never bound to a node: one row each, with the cause word (schemas.words.RefusalCause),
-- the status, the client's model and the message it was sent.
CREATE OR REPLACE VIEW refusals AS
SELECT j->>'request_id' AS request_id, key AS proxy, seq, ts_ns, event_index,
       TRY_CAST(j->>'status' AS INTEGER) AS status,
       (TRY_CAST(j->>'status' AS INTEGER) // 100)::VARCHAR || 'xx' AS status_class,
       j->>'cause' AS cause, j->>'pool' AS pool, j->>'model' AS model, j->>'key_name' AS key_name,
       j->>'error' AS error
FROM input_events WHERE family = 'lb.req.refused';

-- Requests held by flow control (lb.req.queued.<proxy>), one row each: its pool, band, key,
-- work and TTL, why it was held, and how it left the queue (`ended`: `dispatched` when an
-- lb.req.started with its id followed, else the cause of its lb.req.refused: `queue_timeout`,
-- `no_routable_node`, `client_disconnected`, ...; NULL while still held) and `wait_ms`, from the
-- proxy's own timestamps on the two events (the batch's JetStream time is shared by the events
-- of one batch).
CREATE OR REPLACE VIEW queued AS
WITH held AS (
    SELECT j->>'request_id' AS request_id, key AS proxy, seq, ts_ns, event_index,
           coalesce(j->>'pool', 'default') AS pool, coalesce(j->>'band', 'default') AS band,
           j->>'key_name' AS key_name, TRY_CAST(j->>'work' AS BIGINT) AS work,
           TRY_CAST(j->>'ttl_ms' AS BIGINT) AS ttl_ms, j->>'cause' AS held_because,
           TRY_CAST(j->>'ts_ns' AS BIGINT) AS held_ts_ns
    FROM input_events WHERE family = 'lb.req.queued' AND j->>'request_id' IS NOT NULL
), left_by_start AS (
    SELECT split_part(j->>'request_id', '.', 1) AS request_id, min(TRY_CAST(j->>'ts_ns' AS BIGINT)) AS left_ts_ns
    FROM input_events WHERE family = 'lb.req.started' AND j->>'request_id' IN (SELECT request_id FROM held)
    GROUP BY 1
), left_by_refusal AS (
    SELECT j->>'request_id' AS request_id, min(TRY_CAST(j->>'ts_ns' AS BIGINT)) AS left_ts_ns,
           min(j->>'cause') AS cause, min(TRY_CAST(j->>'status' AS INTEGER)) AS status
    FROM input_events WHERE family = 'lb.req.refused' AND j->>'request_id' IN (SELECT request_id FROM held)
    GROUP BY 1
)
SELECT h.request_id, h.proxy, h.pool, h.band, h.key_name, h.work, h.ttl_ms, h.held_because, h.seq, h.ts_ns,
       CASE WHEN s.request_id IS NOT NULL THEN 'dispatched' ELSE r.cause END AS ended, r.status,
       (coalesce(s.left_ts_ns, r.left_ts_ns) - h.held_ts_ns) / 1e6 AS wait_ms
FROM held h LEFT JOIN left_by_start s USING (request_id) LEFT JOIN left_by_refusal r USING (request_id);

-- Every client request answered with an error, by whom: `engine` (its last attempt ended
-- `engine_error`, a 4xx or other non-2xx the engine sent, or `upstream_error` before any byte
-- reached the client: a 5xx passed through, or the proxy's 502/504 for an engine that failed or
-- timed out, status NULL) or `router` (the proxy's own refusal). cause: the status ('HTTP 404')
-- for an engine's answer, the failure text otherwise, the refusal's cause word for the router.
-- Cuts after the first byte are not here: they are `interruptions`.
CREATE OR REPLACE VIEW error_answers AS
SELECT request_id, 'engine' AS answered_by, status, status_class,
       CASE WHEN status IS NOT NULL THEN 'HTTP ' || status ELSE coalesce(error, outcome) END AS cause,
       node, pool, outcome, finished_seq AS seq, finished_ts_ns AS ts_ns
FROM requests
WHERE outcome = 'engine_error' OR (outcome = 'upstream_error' AND ttft_ms IS NULL)
UNION ALL
SELECT request_id, 'router' AS answered_by, status, status_class, cause, NULL AS node, pool, NULL AS outcome,
       seq, ts_ns
FROM refusals;

-- Continued and retried attempts: one row per attempt that another attempt took over, with the
-- attempt that did. kind: `continued` (a stream broke after the client got part of it and went
-- on elsewhere) or `retried` (failed before any byte reached the client; non-streamed
-- requests are retried whole). tokens_before: completion tokens the client had received over
-- the request's attempts up to this one (a prefill leg's one token is not sent to the client);
-- tokens_after: those the next attempt sent. added_ms:
-- from the break (this attempt's end) to the next attempt's first byte to the client, both
-- counted by the proxy from the request's arrival. The attempt that took over is the typed
-- `next_attempt` of the finished event; reason is the error text, for people. In a
-- prefill/decode pool the attempt that takes over may be a new pair's prefill leg, which sends the
-- client nothing: tokens_after, added_ms and next_outcome are then those of the first attempt
-- from it on that is not a prefill leg (the new pair's decode leg).
CREATE OR REPLACE VIEW continuations AS
WITH numbered AS (
    SELECT *, sum(CASE WHEN role IS DISTINCT FROM 'prefill' THEN coalesce(completion_tokens, 0) ELSE 0 END) OVER (
               PARTITION BY request_id ORDER BY started_seq, started_index ROWS UNBOUNDED PRECEDING) AS tokens_so_far,
           first_value(CASE WHEN role IS DISTINCT FROM 'prefill' THEN attempt_id END IGNORE NULLS) OVER (
               PARTITION BY request_id ORDER BY started_seq, started_index
               ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS answering
    FROM attempts
), taken_over AS (
    SELECT *, next_attempt AS next_id FROM numbered WHERE next_attempt IS NOT NULL
)
SELECT t.request_id, t.attempt_id, t.next_id AS next_attempt,
       CASE WHEN t.outcome = 'continued' THEN 'continued' ELSE 'retried' END AS kind,
       t.node, n.node AS next_node, t.pool, t.error AS reason,
       t.tokens_so_far AS tokens_before, a.completion_tokens AS tokens_after,
       t.duration_ms AS broke_at_ms, a.first_byte_ms - t.duration_ms AS added_ms, a.outcome AS next_outcome,
       t.finished_seq, t.finished_ts_ns
FROM taken_over t LEFT JOIN numbered n ON n.attempt_id = t.next_id
LEFT JOIN attempts a ON a.attempt_id = n.answering;

-- Requests the scheduler stopped counting (lb.out.voided.<proxy>, schemas.outputs.RequestsVoided):
-- one row per voided attempt, with the input that voided it (voided_seq), the proxy, the cause
-- (schemas.words.VoidCause: `proxy_stopped`, `proxy_silent` — no heartbeat for proxy_timeout_ms —,
-- `proxy_replaced` — a new process of the same proxy id —, `finish_lost` — the live proxy counts
-- fewer in flight) and the boot id of the process that replaced it.
CREATE OR REPLACE VIEW voided AS
SELECT * FROM (
    SELECT TRY_CAST(j->>'as_of_seq' AS BIGINT) AS voided_seq, j->>'proxy' AS proxy, j->>'cause' AS cause,
           j->>'boot_id' AS boot_id, unnest(TRY_CAST(j->'request_ids' AS VARCHAR[])) AS attempt_id, seq AS out_seq,
           ts_ns AS out_ts_ns
    FROM output_events WHERE subject LIKE 'lb.out.voided.%' AND j IS NOT NULL)
QUALIFY row_number() OVER (PARTITION BY attempt_id, voided_seq ORDER BY out_seq) = 1;

-- Requests still open (no finished event) whose last attempt the scheduler voided: request_id,
-- voided_seq, cause (as in `voided`).
CREATE OR REPLACE VIEW voided_requests AS
SELECT r.request_id, min(v.voided_seq) AS voided_seq, arg_min(v.cause, v.voided_seq) AS cause
FROM requests r
JOIN attempts a ON a.request_id = r.request_id AND a.started_seq = r.last_attempt_seq
               AND a.started_index = r.last_attempt_index
JOIN voided v ON v.attempt_id = a.attempt_id
WHERE r.outcome IS NULL
GROUP BY r.request_id;

-- Cuts the client saw: outcome router_aborted; streams whose last attempt ended with an
-- upstream error after the client got part of them (`engine_cut`: an engine died mid-stream and
-- the stream was not continued elsewhere; a continued stream's outcome is its last attempt's);
-- requests whose last attempt was still open when its proxy was known gone (`proxy_gone`: the
-- scheduler voided it, `voided_requests`, because the proxy fell silent for proxy_timeout_ms or
-- a new process of the same proxy id started: it died with them; proxy_stopped_seq is then the
-- input that voided them); requests whose last attempt was still open when
-- its proxy announced a clean stop (`lb.proxy.stopped.<proxy>` after that attempt began); and,
-- when the log ends after a clean shutdown (its last proxy event is a stop: no request event
-- or heartbeat follows the last `lb.proxy.stopped`), requests left open by a proxy that never
-- announced a stop (it died with them in flight). Requests open on a proxy still alive at the
-- end of a log are not here: their fate is unknown (see `open_requests`). Nor are requests the
-- scheduler voided as `finish_lost` (their proxy's heartbeat counted them no longer in flight:
-- their finished event was lost, e.g. dropped by a proxy whose event buffer overflowed).
CREATE OR REPLACE VIEW proxy_stops AS
SELECT key AS proxy, seq, ts_ns, event_index FROM input_events WHERE family = 'lb.proxy.stopped';

CREATE OR REPLACE VIEW clean_end AS
WITH last_stop AS (SELECT seq, event_index FROM proxy_stops ORDER BY seq DESC, event_index DESC LIMIT 1)
SELECT l.seq AS last_stop_seq FROM last_stop l
WHERE NOT EXISTS (
    SELECT 1 FROM input_events e
    WHERE e.family IN ('lb.req.started', 'lb.req.finished', 'lb.proxy.heartbeat')
      AND (e.seq, e.event_index) > (l.seq, l.event_index));

CREATE OR REPLACE VIEW interruptions AS
WITH gone AS (SELECT request_id, voided_seq FROM voided_requests WHERE cause IN ('proxy_silent', 'proxy_replaced')),
lost AS (SELECT request_id FROM voided_requests WHERE cause = 'finish_lost')
SELECT r.*, 'router_aborted' AS reason, NULL::BIGINT AS proxy_stopped_seq
FROM requests r WHERE r.outcome = 'router_aborted'
UNION ALL
SELECT r.*, 'engine_cut' AS reason, NULL::BIGINT AS proxy_stopped_seq
FROM requests r WHERE r.outcome = 'upstream_error' AND r.ttft_ms IS NOT NULL
UNION ALL
SELECT r.*, 'proxy_gone' AS reason, g.voided_seq AS proxy_stopped_seq
FROM requests r JOIN gone g USING (request_id)
UNION ALL
SELECT r.*, 'open_at_proxy_stop' AS reason, min(p.seq) AS proxy_stopped_seq
FROM requests r JOIN proxy_stops p
  ON p.proxy = r.proxy AND (p.seq, p.event_index) > (r.last_attempt_seq, r.last_attempt_index)
WHERE r.outcome IS NULL AND r.request_id NOT IN (SELECT request_id FROM gone)
  AND r.request_id NOT IN (SELECT request_id FROM lost)
GROUP BY ALL
UNION ALL
SELECT r.*, 'open_at_end' AS reason, NULL::BIGINT AS proxy_stopped_seq
FROM requests r, clean_end
WHERE r.outcome IS NULL AND r.request_id NOT IN (SELECT request_id FROM gone)
  AND r.request_id NOT IN (SELECT request_id FROM lost)
  AND NOT EXISTS (SELECT 1 FROM proxy_stops p
                  WHERE p.proxy = r.proxy AND (p.seq, p.event_index) > (r.last_attempt_seq, r.last_attempt_index));

-- Requests never finished and not interrupted: open on a proxy still alive (as far as the log
-- knows), so their fate is unknown. A request whose finished event was lost (the live proxy's
-- heartbeat counted fewer in flight: `voided_requests` with cause `finish_lost`) is not here.
CREATE OR REPLACE VIEW open_requests AS
SELECT r.* FROM requests r
WHERE r.outcome IS NULL AND r.request_id NOT IN (SELECT request_id FROM interruptions)
  AND r.request_id NOT IN (SELECT request_id FROM voided_requests WHERE cause = 'finish_lost');

-- Attempts admitted to a node that the snapshot the proxy routed on (as_of_seq = snapshot_seq,
-- same pool) showed as not routable or with effective weight 0, or did not list at all. Every
-- attempt is a routing decision, so retries are checked too. An attempt whose snapshot_seq
-- names no recorded snapshot cannot be judged and is not listed.
CREATE OR REPLACE VIEW admissions_to_draining AS
SELECT r.request_id, r.attempt_id, r.node, r.pool, r.proxy, r.started_seq, r.started_ts_ns, r.snapshot_seq,
       w.phase, w.routable, w.effective_weight, r.outcome,
       CASE WHEN w.node IS NULL THEN 'node_absent'
            WHEN NOT w.routable THEN 'not_routable'
            ELSE 'zero_weight' END AS verdict
FROM attempts r
JOIN (SELECT DISTINCT pool, as_of_seq FROM snapshot_nodes) s
  ON s.pool = r.pool AND s.as_of_seq = r.snapshot_seq
LEFT JOIN snapshot_nodes w ON w.pool = r.pool AND w.as_of_seq = r.snapshot_seq AND w.node = r.node
WHERE w.node IS NULL OR NOT w.routable OR w.effective_weight <= 0;

-- Every phase a node entered, at which input: the lb.out.phase outputs, completed from the
-- snapshots (a phase change whose lb.out.phase message shares its Nats-Msg-Id with an earlier
-- one of the same input is still visible as the node's phase in that input's snapshot).
CREATE OR REPLACE VIEW phase_marks AS
WITH from_snapshots AS (
    SELECT out_seq, as_of_seq, node, pool, phase AS to_phase, phase_cause AS cause, phase_reason AS reason,
           lag(phase) OVER (PARTITION BY node ORDER BY as_of_seq, out_seq) AS before
    FROM snapshot_nodes
), marks AS (
    SELECT out_seq, as_of_seq, node, pool, to_phase, cause, reason FROM phase_changes
    UNION ALL
    SELECT out_seq, as_of_seq, node, pool, to_phase, cause, reason FROM from_snapshots
    WHERE before IS DISTINCT FROM to_phase
)
SELECT m.*, e.ts_ns FROM marks m JOIN input_messages e ON e.seq = m.as_of_seq
QUALIFY row_number() OVER (PARTITION BY m.node, m.as_of_seq, m.to_phase ORDER BY m.out_seq) = 1;

-- Drains: from a node entering `draining` to its next phase change, when that is `drained`.
-- drained_by = 'inflight' when in-flight reached 0, 'deadline' when the drain deadline cut it
-- short (the phase change's cause `drain_deadline`). The reasons are text for people.
-- last_attempt_ts_ns: the end of the last attempt (a P/D pair's leg counts on its own node) that
-- finished on the node by the drained input; after_last_attempt_ms: from that end, or from the
-- drain's start when the node had nothing left then, to drained (NULL unless drained by
-- in-flight): how long the node stayed draining with nothing on it. later_legs: attempts of the
-- requests the node served while draining that ran on other nodes and ended after it turned
-- drained (a P/D pair's decode leg, which its prefill node does not wait for).
CREATE OR REPLACE VIEW drains AS
SELECT s.node, s.pool, s.as_of_seq AS started_seq, s.ts_ns AS started_ts_ns, s.cause AS started_cause,
       s.reason AS started_reason,
       d.as_of_seq AS drained_seq, d.ts_ns AS drained_ts_ns,
       (d.ts_ns - s.ts_ns) / 1e6 AS duration_ms,
       CASE WHEN d.node IS NULL THEN NULL
            WHEN d.cause = 'drain_deadline' THEN 'deadline' ELSE 'inflight' END AS drained_by,
       d.cause AS drained_cause, d.reason AS drained_reason,
       l.last_ts_ns AS last_attempt_ts_ns,
       CASE WHEN d.node IS NOT NULL AND d.cause IS DISTINCT FROM 'drain_deadline'
            THEN (d.ts_ns - greatest(s.ts_ns, coalesce(l.last_ts_ns, s.ts_ns))) / 1e6 END AS after_last_attempt_ms,
       o.later_legs AS later_legs
FROM phase_marks s
LEFT JOIN LATERAL (
    SELECT * FROM phase_marks m
    WHERE m.node = s.node AND m.to_phase <> 'draining'
      AND (m.as_of_seq > s.as_of_seq OR (m.as_of_seq = s.as_of_seq AND m.out_seq > s.out_seq))
    ORDER BY m.as_of_seq, m.out_seq LIMIT 1
) n ON true
LEFT JOIN phase_marks d ON d.node = n.node AND d.out_seq = n.out_seq AND d.to_phase = 'drained'
LEFT JOIN LATERAL (
    SELECT max(a.finished_ts_ns) AS last_ts_ns FROM attempts a
    WHERE a.node = s.node AND a.finished_seq <= d.as_of_seq
) l ON true
LEFT JOIN LATERAL (
    SELECT count(DISTINCT o.attempt_id) AS later_legs FROM attempts a JOIN attempts o
        ON o.request_id = a.request_id AND o.node <> a.node
    WHERE a.node = s.node AND a.finished_seq BETWEEN s.as_of_seq AND d.as_of_seq
      AND (o.finished_seq IS NULL OR o.finished_seq > d.as_of_seq)
) o ON d.node IS NOT NULL
WHERE s.to_phase = 'draining';

-- Every input the scheduler rejected (lb.out.rejected), once, at the input's time: input_seq
-- names it, key is its subject's last token (a node for admin events, samples and probes; the
-- proxy for a batch, with event_index), cause the code (schemas.words.RejectCause), reason the
-- text for people.
CREATE OR REPLACE VIEW rejections AS
WITH r AS (
    SELECT seq AS out_seq, TRY_CAST(j->>'as_of_seq' AS BIGINT) AS input_seq, j->>'subject' AS subject,
           TRY_CAST(j->>'event_index' AS BIGINT) AS event_index, j->>'cause' AS cause, j->>'reason' AS reason
    FROM output_events WHERE subject = 'lb.out.rejected' AND j IS NOT NULL
    QUALIFY row_number() OVER (PARTITION BY input_seq, event_index ORDER BY seq) = 1
)
SELECT r.input_seq, i.ts_ns, r.subject, split_part(r.subject, '.', -1) AS key, r.event_index, r.cause, r.reason,
       r.out_seq
FROM r LEFT JOIN input_messages i ON i.seq = r.input_seq;

-- Every admin command naming a node (lb.admin.node|capacity|drain|undrain|remove.<node>) with
-- the scheduler's verdict: applied, or rejected with the reason (a capacity of -1 or 2.5, an
-- unknown node id, a URL outside the allow-list). capacity is NULL unless a whole number.
CREATE OR REPLACE VIEW admin_commands AS
SELECT e.seq, e.ts_ns, e.key AS node, split_part(e.family, '.', 3) AS kind,
       TRY_CAST(e.j->>'capacity' AS BIGINT) AS capacity, e.data AS body,
       r.input_seq IS NULL AS applied, r.cause AS rejected_cause, r.reason AS rejected_reason
FROM input_events e
LEFT JOIN rejections r ON r.input_seq = e.seq AND r.event_index IS NULL
WHERE e.family LIKE 'lb.admin.%';

-- Per capacity or drain event (lb.admin.capacity|drain|remove|undrain): the node's weight ramp
-- and in-flight curve from that event until the node's next such applied event (or the end of
-- the log), the time until the ramp settled (effective within 1% of capacity of its target),
-- and, for events that started a drain, when and how it ended. A rejected command is listed
-- with applied = false and its reason, and has no ramp, settle time or next_seq.
CREATE OR REPLACE VIEW admin_changes AS
SELECT seq, ts_ns, node, kind, capacity, applied, rejected_reason,
       CASE WHEN applied THEN lead(seq) OVER (PARTITION BY node, applied ORDER BY seq) END AS next_seq
FROM admin_commands
WHERE kind IN ('capacity', 'drain', 'remove', 'undrain');

CREATE OR REPLACE VIEW drain_timeline AS
WITH curve AS (
    SELECT a.seq AS event_seq, w.*
    FROM admin_changes a
    JOIN weights_over_time w ON a.applied AND w.node = a.node AND w.as_of_seq >= a.seq
                             AND (a.next_seq IS NULL OR w.as_of_seq < a.next_seq)
), summary AS (
    SELECT event_seq,
           list(struct_pack(ts_ns, tick, phase, effective_weight, target_weight, inflight)
                ORDER BY as_of_seq) AS ramp,
           min(ts_ns) FILTER (WHERE abs(effective_weight - target_weight) <= 0.01 * greatest(capacity, 1))
               AS settled_ts_ns,
           min(ts_ns) FILTER (WHERE inflight = 0) AS inflight_zero_ts_ns
    FROM curve GROUP BY event_seq
)
SELECT a.seq AS event_seq, a.ts_ns, a.node, a.kind, a.capacity,
       (s.settled_ts_ns - a.ts_ns) / 1e6 AS settle_ms,
       d.drained_ts_ns, d.duration_ms AS time_to_drained_ms, d.drained_by,
       s.ramp AS ramp, a.applied, a.rejected_reason
FROM admin_changes a
LEFT JOIN summary s ON s.event_seq = a.seq
LEFT JOIN drains d ON d.node = a.node AND d.started_seq = a.seq;

-- What happened to each node, in order (`laswrr history NODE`): admin commands with their
-- verdict, phase changes (an ejection's reason is its cause), capacity as the snapshots show it
-- when it changes, and rejected inputs naming the node (samples, health probes). seq is the
-- input; rank orders rows of one input (command, phase changes, capacity, rejection).
CREATE OR REPLACE VIEW node_timeline AS
SELECT ts_ns, seq, node, kind, detail FROM (
    SELECT ts_ns, seq, 0 AS rank, node, 'admin ' || kind AS kind,
           CASE WHEN applied THEN 'applied ' ELSE 'REJECTED ' END || body
           || coalesce(': ' || rejected_reason, '') AS detail
    FROM admin_commands
    UNION ALL
    SELECT ts_ns, as_of_seq, 1, node, CASE WHEN to_phase = 'ejected' THEN 'ejected' ELSE 'phase' END,
           to_phase || coalesce(' (' || reason || ')', '')
    FROM phase_marks
    UNION ALL
    SELECT ts_ns, as_of_seq, 2, node, 'capacity', coalesce(before::VARCHAR || ' -> ', '') || capacity::VARCHAR
    FROM (SELECT ts_ns, as_of_seq, node, capacity,
                 lag(capacity) OVER (PARTITION BY node ORDER BY as_of_seq, out_seq) AS before
          FROM snapshot_nodes)
    WHERE before IS DISTINCT FROM capacity
    UNION ALL
    SELECT ts_ns, input_seq, 3, key, 'rejected', subject || ': ' || reason
    FROM rejections
    WHERE subject NOT LIKE 'lb.admin.%' AND event_index IS NULL
)
ORDER BY seq, rank;

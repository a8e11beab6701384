"""The proxy's routing core, pure: what a proxy decides for a request, with no IO.

The live proxy (``services/proxy``), the virtual-time bench (``bench/virtual.py``) and
replay-style tests run this same code; the proxy feeds it snapshots, request bytes and time
(``now``, monotonic seconds) and seeds it (its ``--seed`` and the pool name). Like the rest of
``scheduler/`` it touches no clock, socket, asyncio or randomness (tests/scheduler/test_purity.py).

Modules:

* ``router``: ``Router``, the parts below built together from the proxy's settings.
* ``table``: the routing table (``RoutingTable``): the newest snapshot of each pool (``offer``,
  ``forget``, ``new_stream``) and its views for the shell (``snapshots``, ``candidates``, ...).
* ``route``: one pool's route (``PoolRoute``): one ``Picker`` per node role (whole, or a P/D
  pool's prefill and decode), the other replicas' in-flight.
* ``load``: the live counts a pick weighs (own in-flight, the pool-wide estimate, prefill backlogs).
* ``work``: prefix affinity's scorer (``PrefixScorer``) and P/D prefill speeds.
* ``admission``: ``Admitter.admit(AdmitRequest)`` -> ``Admission | Refusal``, ``release``.
* ``peers``: the channel between proxies, sans IO (``PeerChannel``): takes the messages
  received, says what to send (the shell drains its outboxes).
* ``models``: a request's model id -> its pool, the nodes that serve it and the id each is sent.
* ``pd``: the bodies of a prefill/decode pair's two legs (the ``vllm`` and ``sglang`` protocols).
* ``prompt``: the prompt text the prefix index hashes and the request's size
  (``RequestSize``: prompt tokens at ~4 characters a token, the output limit).
* ``continuation``: continuing a broken stream on another node: which requests may be
  continued, SSE framing, reading what the client was sent (``StreamText``), rewriting the new
  node's events into one completion, and the continuation request's body.
* ``attempts``: what the proxy does after each attempt of a request (retry, continue, a new
  prefill/decode pair, give up), one transition table keyed by the attempt's leg and outcome.
* ``flow``: flow control's rules: the order held requests leave in (bands, deficit round robin
  between tenants, bounds, TTL), Retry-After and per-key rate limits.

The pick. ``Admitter.admit`` runs the same steps for every request and every policy: the pool's
snapshot; the excluded nodes (tried for this request; at their limit, ``at_limit``:
``--inflight-cap-per-capacity``'s cap, and with flow control the snapshot's
``concurrency_limit``); the request's work (``Affinity``) when the policy ``uses_affinity``;
then ``policy.pick(PickContext(load, exclude, affinity))``, which every policy implements and
may read as much or as little of as it needs (``scheduler.policies.base``). When no node is
picked, the ``Refusal`` says why: ``NO_SNAPSHOT`` (no such pool), ``NO_ROUTABLE_NODE``, and
``saturated`` (routable untried nodes exist, all at their limit).

Where features plug in (docs/proxy.md, "The routing core"):

* **Flow control** (hold what the fleet cannot take yet). The saturation test is the limit step
  of ``admit`` (``at_limit``: the cap, and the snapshot's per-node ``concurrency_limit``), a
  step before the pick, so every policy sees saturated nodes as excluded. A ``saturated``
  refusal means "hold it" where the others mean "answer now". Held requests
  late-bind by calling ``admit`` again (the normal pick, on the snapshot in force then) when
  ``release`` frees a slot or ``offer`` installs a snapshot that adds room; so a held request
  is never bound to a draining or ejected node (never a target) and an admitted one is still
  never cut. Their order (``flow``) is as pure as the rest: it gets ``now`` from the proxy.
* **Prefill/decode pairs** (a P/D pool: ``prefill`` and ``decode`` nodes naming one
  ``pd_protocol``). The pool route keeps one picker per role (``route``); a pair is two
  admissions, the prefill pick with affinity, flow limits and the prefill backlog, the decode
  pick without (``AdmitRequest.role`` decode: never held), each an ``Admission`` released on its
  own, so drains, slow start and "never cut" hold per node and role as for a whole request.
  ``pd`` writes the two legs' bodies; the proxy runs them (``services/proxy/pairs.py``).
"""

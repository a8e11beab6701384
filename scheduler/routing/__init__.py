"""The proxy's routing core, pure: what a proxy decides for a request, with no IO.

The live proxy (``services/proxy``), the virtual-time bench (``bench/virtual.py``) and
replay-style tests run this same code; the proxy feeds it snapshots, request bytes and time
(``now``, monotonic seconds) and seeds it (its ``--seed`` and the pool name). Like the rest of
``scheduler/`` it touches no clock, socket, asyncio or randomness (tests/scheduler/test_purity.py).

Modules:

* ``router``: the routing table (``Router``): the newest snapshot of each pool (``PoolRoute``),
  one pick policy per pool (``scheduler.policies``), the pool-wide in-flight view
  (``others_inflight`` plus this proxy's own live counts), the prefix index and prefill backlog
  of prefix affinity, the prefill/decode pairs, the channel between proxies, and admission
  (``Router.admit`` -> ``Admission``, ``release``).
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

The pick. ``Router.admit`` runs the same steps for every request and every policy: the pool's
snapshot; the excluded nodes (tried for this request; at their limit, ``at_limit``:
``--inflight-cap-per-capacity``'s cap, and with flow control the snapshot's
``concurrency_limit``); the request's work (``Affinity``) when the policy ``uses_affinity``;
then ``policy.pick(PickContext(load, exclude, affinity))``, which every policy implements and
may read as much or as little of as it needs (``scheduler.policies.base``). When no node is
picked, ``Router.refusal`` says why: ``NO_POOL``, ``NO_NODE`` (nothing routable and untried) or
``SATURATED`` (routable untried nodes exist, all at their limit).

Where features plug in (docs/proxy.md, "The routing core"):

* **Flow control** (hold what the fleet cannot take yet). The saturation test is the limit step
  of ``admit`` (``at_limit``: the cap, and the snapshot's per-node ``concurrency_limit``), a
  step before the pick, so every policy sees saturated nodes as excluded. ``SATURATED`` is the
  answer that means "hold it" where ``NO_NODE``/``NO_POOL`` mean "answer now". Held requests
  late-bind by calling ``admit`` again (the normal pick, on the snapshot in force then) when
  ``release`` frees a slot or ``offer`` installs a snapshot that adds room; so a held request
  is never bound to a draining or ejected node (never a target) and an admitted one is still
  never cut. Their order (``flow``) is as pure as the rest: it gets ``now`` from the proxy.
* **Prefill/decode pairs** (a P/D pool: ``prefill`` and ``decode`` nodes naming one
  ``pd_protocol``). The pool route keeps one policy and one candidate set per role; a pair is
  two picks, the prefill pick with affinity, flow limits and the prefill backlog, the decode
  pick without (``admit(..., role=decode)``: never held), each an ``Admission`` released on its
  own, so drains, slow start and "never cut" hold per node and role as for a whole request.
  ``pd`` writes the two legs' bodies; the proxy's forwarder (``services/proxy/upstream.py``) runs them.
"""

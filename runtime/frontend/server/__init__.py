"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), one process apart from the coordinator.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events in OpenAI's chunk format, ``data: [DONE]`` last),
``GET /v1/models``, ``GET /health`` (503 unless the engine serves),
``GET /metrics`` (Prometheus text), and vLLM's ``POST /tokenize``,
``POST /detokenize`` and ``GET /version``; with ``--debug-endpoints`` also
``GET /debug/trace`` (:mod:`runtime.frontend.debug`).

A request is validated (:mod:`runtime.frontend.protocol`), tokenized, and
each of its ``n`` choices is submitted to the coordinator as its own request
(seeds ``seed``, ``seed + 1``, ...).  Outputs are detokenized incrementally;
stop strings hold text back until they are ruled out, and stop token ids end
a choice.  Each time text reaches the client (an SSE chunk written), the
frontend reports the publication (request, fence, host time) to the
coordinator, which applies it before that request's next completion: output
age is measured to what the client saw.  A non-streaming response becomes
visible only at its end, so it reports nothing.  A choice that ends on the
frontend (stop string, stop token) or whose client disconnects is cancelled at
the coordinator, which stops selecting it at once.

Reliability (:class:`~.admission.Gate`, set up by :mod:`runtime.frontend.serve`; see
``docs/serving.md``): a coordinator silent for ``--heartbeat-timeout``
seconds makes new requests 503 at once, ends open ones with an error event
and /health 503 saying why (until it is heard again); a draining or stopping
server answers new requests 503 with ``Retry-After``; beyond the coordinator's
resident requests plus ``--max-waiting-requests`` open choices, 429 with
``Retry-After``.

Every invalid input gets a 4xx JSON error in OpenAI's shape naming the field.
With an API key, every route but /health and /version requires
``Authorization: Bearer KEY`` (the scheme in any case, as HTTP says).

Prefix caching: each choice's ``Submit`` carries its chat messages' token
endpoints and a cache salt (requests share cached KV pages only with equal
salts).  The salt is the request's ``cache_salt``; with several API keys each
key also has its own salt (:func:`~.auth.tenant_salts`: a keyed hash, never the key),
combined with the request's (:func:`~.auth.combined_salt`), so tenants never share
cached pages.  ``usage.prompt_tokens_details.cached_tokens`` reports the prompt
tokens found in the cache (:class:`~.usage.Usage`).

Modules, one concept each: ``app`` wires the FastAPI app (:func:`~.app.create_app`);
``openai_routes`` and ``admin_routes`` hold the routes; ``state`` what they share
(:class:`~.state.Frontend`); ``admission`` the Gate and its tickets; ``auth`` the API
keys and tenant salts; ``body`` reads and prepares request bodies; ``generation``
runs a request's choices at the coordinator; ``responses`` shapes them into SSE
chunks or JSON, with ``logprobs`` and ``usage``; ``errors`` the error responses.
"""

"""The adapter: the only code that touches vLLM, for vLLM 0.26 (GPU, V2 runner) to 0.32 (CPU, V1).

The next vLLM release should be a change inside this package only. One module per vLLM
component it adapts; each calls dynsteer back through the small callback interfaces its
``install`` takes, and none imports dynsteer (a test checks both rules):

* :mod:`.frontend`: engine arguments (enable the worker extension, normalize the options) and
  the input processor (admit or reject a request's spec before vLLM builds it; the client sees
  HTTP 400); the engine-client calls the control plane uses (``collective_rpc``, utilities).
* :mod:`.scheduler`: the engine core's side of the prefix-cache guard: block-hash extra keys,
  ``cache_blocks``, ``free`` and the workers' report on each step's output.
* :mod:`.worker`: model runners (``load_model``, per-step hooks of the V1 and V2 runners, the
  step output that carries the guard report) and the worker extension's view of its runner.
* :mod:`.model`: vLLM's decoder-layer contract: where the residual stream is, how a site is
  wrapped into a layer, which layers a pipeline stage does not own.
* :mod:`.server`: vLLM's OpenAI server entry point and version.
* :mod:`.compile_cache`: vLLM 0.32's CPU build never reloads its own compile cache; a no-op
  method makes it (10-40 s saved per engine start).
* :mod:`.inductor`: torch Inductor's launch decision for the kernels fused sites are in (a
  persistent reduction, as stock's norms run, instead of the looped one Inductor writes).
* :mod:`.patching`: replace an attribute once, patch a module only when something imports it.
"""

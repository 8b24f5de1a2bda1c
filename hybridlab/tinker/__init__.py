"""The Tinker training API served by hybridlab's workers: ``hybridlab serve tinker``.

``settings.py`` what a server serves; ``service.py`` the models, samplers and saved weights on
hybridlab's worker set; ``workers.py`` the trainer and sampler roles; ``losses.py`` Tinker's
losses; ``wire.py`` its protobuf bodies; ``futures.py`` request ids, polls and ordering;
``routes.py`` the HTTP routes; ``server.py`` the aiohttp server. See docs/tinker.md.
"""

"""The composition root: the one place where the parts are assembled into what runs.

`worker` builds one worker process (catalogue, cache, batchers, protocols) and owns its
lifecycle; `stack` builds the stack on one machine (workers, the front door, the hedging lane,
the admin lane) and supervises it; `up` turns the `tailserve up` flags into the stack's config.
"""

"""The relay core: a request's body and its producer (``body``), its lifecycle and phases
(``state``), what it is reported with at the end (``accounting``), the stall limit for writes
the server cannot bound (``stall``), and bounded admission queues (``admission``).

It stands on trio, and on quart's ``ResponseBody`` interface (the body is one, so the app can
return it), not on the server libraries: the HTTP layer (``proxy.server``) drives it.
See ``body``'s docstring for how chunks flow and the order in which a request ends."""

"""The relay core, trio only: a request's body and its producer (``body``), the stall limit for
writes the server cannot bound (``stall``), and bounded admission queues (``admission``).
See ``body``'s docstring for how chunks flow and the order in which a request ends."""

"""Running Sift's processes: the local stack that ``sift up``, ``sift demo`` and the tests start
(:mod:`.stack`), the supervisor that starts again one of them that exits (:mod:`.supervisor`),
the locks on a data folder (:mod:`.folder_locks`), ``sift worker``'s worker processes on every
core under one supervisor (:mod:`.workers`), and the cores a process may use (:mod:`.machine`).

This file imports nothing.
"""

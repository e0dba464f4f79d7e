"""memplan client: the wire contract (`client.contract`), the HTTP SDK and the `memplan` CLI.

Light by design: importing `client` never imports torch, fastapi or ortools.
"""

from client.contract import *  # noqa: F403
from client.contract import __all__ as _contract_all

__version__ = "0.1.0"
__all__ = [*_contract_all, "__version__"]

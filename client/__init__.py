"""memplan client: the wire contract (`client.contract`), the HTTP SDK and the `memplan` CLI.

Light by design: importing `client` never imports torch, fastapi or ortools.
"""

from client.contract import *  # noqa: F403
from client.contract import __all__ as _contract_all

__version__ = "0.1.0"
__all__ = [*_contract_all, "__version__"]

from client.errors import *  # noqa: E402,F403
from client.errors import MemplanError  # noqa: E402
from client.sdk import AsyncClient, Client  # noqa: E402

__all__ += ["AsyncClient", "Client", "MemplanError"]

# mitmdump addon for bench/peers.sh: the same credential egressd injects (file named by PEERS_SECRET_FILE).
import os; AUTH = "Bearer " + open(os.environ["PEERS_SECRET_FILE"]).read().strip()
def request(flow): flow.request.headers["Authorization"] = AUTH

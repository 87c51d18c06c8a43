import socket
import sys
import time

N = int(sys.argv[1])
port = int(sys.argv[2])
socks = []
for i in range(N):
    s = socket.socket()
    s.settimeout(2)
    s.connect(("127.0.0.1", port))
    socks.append(s)
print("opened", len(socks))
time.sleep(4)
t = time.time()
with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    print("legit", time.time() - t, s.recv(60))
alive = 0
for s in socks:
    s.setblocking(False)
    try:
        d = s.recv(1)
        alive += d != b""
    except BlockingIOError:
        alive += 1
    except Exception:
        pass
print("still open", alive)

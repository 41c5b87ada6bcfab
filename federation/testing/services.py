"""A service replica for tests: a tiny HTTP server that answers with its replica index."""

HTTP_REPLICA = """
import http.server, os
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(os.environ["FEDERATION_REPLICA"].encode())
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["FEDERATION_PORT"])), Handler).serve_forever()
"""
"""Code for ``python -c``: serves on FEDERATION_PORT, answering GET with FEDERATION_REPLICA."""

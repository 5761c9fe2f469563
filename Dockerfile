# hmpnode container image (docs/operations.md, "Container image").
#
#   docker build -t hmpnode .
#   docker volume create hmpnode-data
#   docker run -d --name hmpnode -v hmpnode-data:/data \
#       -p 127.0.0.1:7410:7410 -p 7420:7420 -p 7421:7421/udp hmpnode
#   docker exec hmpnode hmpnode status          # the CLI inside finds the node through /data
#   docker exec hmpnode cat /data/api.token     # the API token, made on first start
#
# Ports (all fixed here so that they can be published; the node's own default is 0, a free one):
#   7410/tcp  agent API (bearer token; /healthz without). Publish it on 127.0.0.1 only.
#   7420/tcp  peer port (HTTP/WebSocket, Noise-encrypted sessions with other nodes)
#   7421/udp  Kademlia DHT
# LAN discovery (UDP 47474, multicast/broadcast) does not cross Docker's bridge network;
# use --network host, or peer.bootstrap, for a node that should find others by itself.
#
# Nothing secret is in the image: the identity keystore and the API token are created in
# the /data volume on first start (mode 0600, owned by the hmpnode user, uid 10001).
# A bind mount instead of a volume must be owned by uid 10001 with mode 0700.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hmpnode ./hmpnode
COPY schemas ./schemas
# the wheel and every dependency as wheels: the final stage installs offline, without a compiler
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home --shell /usr/sbin/nologin hmpnode \
    && mkdir -m 0700 /data && chown hmpnode:hmpnode /data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels hmpnode && rm -rf /wheels
USER hmpnode
ENV HMPNODE_DATA_DIR=/data \
    PYTHONUNBUFFERED=1
VOLUME ["/data"]
EXPOSE 7410/tcp 7420/tcp 7421/udp
# /healthz: 200 while the node takes requests, 503 while it stops or its disk is full
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7410/healthz', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["hmpnode"]
# The API listens on every interface of the container (the node logs that it does): the
# published port decides who reaches it, hence -p 127.0.0.1:7410:7410 above.
CMD ["run", "--data-dir", "/data", "--log-format", "json", "--api-host", "0.0.0.0", "--api-port", "7410", \
     "--peer-port", "7420", "--dht-port", "7421"]

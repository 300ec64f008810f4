// Loaded with `node --import` before Portkey's gateway 1.15.2 (proxy.bench.peers.start).
//
// Its headers: on Node its streamed answers fail ({"status":"failure"}, "TypeError:
// immutable") because it adds its x-portkey-* headers to the upstream's fetch Response, whose
// headers are immutable (Portkey-AI/gateway#1550, #1389). Such a header change is skipped
// here instead: the answer relays as it came.
//
// Its address: it listens on every interface, with no flag to say otherwise; like every peer
// the bench starts, it is bound to loopback here.
import net from "node:net";

const guarded = (name) => {
  const original = Headers.prototype[name];
  Headers.prototype[name] = function (...args) {
    try {
      return original.apply(this, args);
    } catch (error) {
      if (error instanceof TypeError && error.message === "immutable") return undefined;
      throw error;
    }
  };
};
for (const name of ["append", "set", "delete"]) guarded(name);

const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (typeof args[0] === "number" && typeof args[1] !== "string") {
    args.splice(1, args[1] === undefined ? 1 : 0, "127.0.0.1");
  } else if (args[0] && typeof args[0] === "object" && args[0].host === undefined) {
    args[0] = { ...args[0], host: "127.0.0.1" };
  }
  return listen.apply(this, args);
};

// Validate Kubernetes objects against Istio's CRD schemas, as compiled into
// @kubernetes-models/istio (generated from the Istio release's CRDs).
// Usage: node validate.mjs FILE.json  (a JSON array of objects)
// Prints one line per object: "ok KIND NAME" or "invalid KIND NAME: errors"; exits 1 on any
// invalid object, 2 on an object whose apiVersion/kind has no schema.
import { readFileSync } from "node:fs";

const docs = JSON.parse(readFileSync(process.argv[2], "utf8"));
let status = 0;
for (const doc of docs) {
  const [group, version] = doc.apiVersion.split("/");
  const name = doc.metadata?.name ?? "";
  let model;
  try {
    model = (await import(`@kubernetes-models/istio/${group}/${version}/${doc.kind}`))[doc.kind];
  } catch (err) {
    console.log(`unknown ${doc.apiVersion} ${doc.kind} ${name}: no schema`);
    status = Math.max(status, 2);
    continue;
  }
  try {
    new model(doc).validate();
    console.log(`ok ${doc.kind} ${name}`);
  } catch (err) {
    console.log(`invalid ${doc.kind} ${name}: ${err.message}`);
    status = Math.max(status, 1);
  }
}
process.exit(status);

"""Prints a prototype run's claim latency per phase, per 10 s (median / max latency / max
schedule lag, ms) and the sizes and dead versions of the claim path and of the records."""
import sys,glob
out=sys.argv[1]; clean=30; hold=int(sys.argv[2])
start=int(open(out+'/start.txt').read())
ph={'clean':[], 'held':[], 'released':[]}
for f in glob.glob(out+'/pgbench_log.*'):
    for line in open(f):
        p=line.split()
        lat=int(p[2])/1000.0; t=int(p[4])-start
        k='clean' if t<clean else ('held' if t<clean+hold else 'released')
        ph[k].append(lat)
buckets={}
for f in glob.glob(out+'/pgbench_log.*'):
    for line in open(f):
        p=line.split(); t=(int(p[4])-start)//10*10
        buckets.setdefault(t,[]).append((int(p[2])/1000.0, int(p[6])/1000.0 if len(p)>6 else 0.0))
print('per 10 s (median/max latency/max lag, ms): '+' '.join(
    f"{t}s:{sorted(x[0] for x in v)[len(v)//2]:.0f}/{max(x[0] for x in v):.0f}/{max(x[1] for x in v):.0f}"
    for t,v in sorted(buckets.items())))
for k,v in ph.items():
    v.sort()
    if v: print(f"{k:9} n={len(v):6} p50={v[len(v)//2]:7.2f} ms p99={v[int(len(v)*0.99)]:8.2f} ms")
for line in open(out+'/sizes.txt'):
    t,size,dead,rsize,rdead=line.strip().split('|')
    print(f"  t={t:>4}s claim path {int(size)/1e6:6.1f} MB, {dead:>7} dead; records {int(rsize)/1e6:6.1f} MB, {rdead:>7} dead")

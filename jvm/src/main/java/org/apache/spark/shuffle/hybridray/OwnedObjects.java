package org.apache.spark.shuffle.hybridray;

import io.ray.api.ObjectRef;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

/**
 * The memory-tier objects this JVM owns, by Spark shuffle and map attempt. A Ray object
 * lives while its owner holds a reference to it, so keeping the refs here is what keeps a
 * map's memory segments readable. Dropping them does not free the objects by itself: Ray's
 * Java runtime lets go of an object when its {@code ObjectRefImpl} is garbage collected
 * (see {@link HybridRayContext#collectDroppedObjects}). Thread-safe: map tasks add, the
 * shuffle manager and the sender drop.
 */
final class OwnedObjects {
  // Spark shuffle id -> map attempt id -> refs of the memory-tier segments it wrote here.
  private final Map<Integer, Map<Long, List<ObjectRef<byte[]>>>> refs =
      new ConcurrentHashMap<>();
  // Spark shuffles dropped here (unregistered): a task still running for one (a zombie of
  // a cancelled job) must not keep its new objects pinned until this executor exits.
  private final Set<Integer> droppedShuffles = ConcurrentHashMap.newKeySet();

  /** Keep {@code ref}, a memory segment map attempt {@code mapId} wrote, alive. */
  void own(int shuffleId, long mapId, ObjectRef<byte[]> ref) {
    if (droppedShuffles.contains(shuffleId)) {
      return;  // unregistered here: nobody reads it, the object goes with its last ref
    }
    refs.computeIfAbsent(shuffleId, k -> new ConcurrentHashMap<>())
        .computeIfAbsent(mapId, k -> Collections.synchronizedList(new ArrayList<>()))
        .add(ref);
    if (droppedShuffles.contains(shuffleId)) {
      refs.remove(shuffleId);  // dropped while this ref was being kept
    }
  }

  /**
   * Let a map attempt's objects go (it failed, or its output will never be read).
   *
   * @return how many refs were dropped
   */
  int dropAttempt(int shuffleId, long mapId) {
    Map<Long, List<ObjectRef<byte[]>>> maps = refs.get(shuffleId);
    List<ObjectRef<byte[]>> dropped = maps == null ? null : maps.remove(mapId);
    return dropped == null ? 0 : dropped.size();
  }

  /**
   * Let a shuffle's objects go, and those its late tasks would still put.
   *
   * @return how many refs were dropped
   */
  int dropShuffle(int shuffleId) {
    droppedShuffles.add(shuffleId);
    Map<Long, List<ObjectRef<byte[]>>> dropped = refs.remove(shuffleId);
    return dropped == null ? 0 : dropped.values().stream().mapToInt(List::size).sum();
  }

  void dropAll() {
    refs.clear();
  }

  /** How many objects of {@code shuffleId} are kept. */
  int count(int shuffleId) {
    Map<Long, List<ObjectRef<byte[]>>> maps = refs.get(shuffleId);
    return maps == null ? 0 : maps.values().stream().mapToInt(List::size).sum();
  }
}

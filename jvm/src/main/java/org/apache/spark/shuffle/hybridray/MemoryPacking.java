package org.apache.spark.shuffle.hybridray;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

/**
 * Several small memory-tier segments of one batch in one Ray object.
 *
 * <p>Why: a {@code Ray.put} costs about a millisecond here whatever its size (a create and a
 * seal round trip to the node's object store), and a map task of a small exchange writes one
 * segment per reduce partition: at 8 partitions the puts were a third of its fixed cost, at
 * Spark's default 200 partitions they would be most of it. Segments of a batch are therefore
 * put together, in groups of at most {@code packBytes} (a segment that large is put alone).
 * The bound keeps the readers' cost small: a reader fetches the whole object to read its
 * slice, so it copies at most {@code packBytes} per group instead of its segment.
 *
 * <p>A packed segment's location is its object's location (the base64 serialized
 * {@code ObjectRef}) followed by {@code @<offset>:<length>}; base64 never contains '@', so
 * an unpacked segment's location (no suffix) reads as before. Only the JVM reads these
 * locations; the shuffle master keeps them opaque.
 */
final class MemoryPacking {
  static final char SEPARATOR = '@';

  private MemoryPacking() {}

  /**
   * Groups of consecutive indices into {@code sizes}: each group's sizes sum to at most
   * {@code packBytes}, or the group is a single segment. {@code packBytes <= 0}: every
   * segment alone (packing off).
   */
  static List<int[]> groups(int[] sizes, long packBytes) {
    List<int[]> out = new ArrayList<>();
    int start = 0;
    long bytes = 0;
    for (int i = 0; i < sizes.length; i++) {
      if (i > start && (packBytes <= 0 || bytes + sizes[i] > packBytes)) {
        out.add(range(start, i));
        start = i;
        bytes = 0;
      }
      bytes += sizes[i];
    }
    if (start < sizes.length) {
      out.add(range(start, sizes.length));
    }
    return out;
  }

  private static int[] range(int from, int to) {
    int[] r = new int[to - from];
    Arrays.setAll(r, k -> from + k);
    return r;
  }

  /** The location of a slice of the object at {@code objectLocation}. */
  static String location(String objectLocation, int offset, int length) {
    return objectLocation + SEPARATOR + offset + ":" + length;
  }

  /** The location of the object holding the segment at {@code location}. */
  static String objectLocation(String location) {
    int at = location.indexOf(SEPARATOR);
    return at < 0 ? location : location.substring(0, at);
  }

  /**
   * The segment at {@code location} out of its object's bytes: the slice named by the
   * location's suffix, or the object itself if it has none. A slice outside the object
   * (a location that does not belong to it) is an IOException, as for a lost segment.
   */
  static byte[] segment(String location, byte[] object) throws IOException {
    int at = location.indexOf(SEPARATOR);
    if (at < 0) {
      return object;
    }
    String suffix = location.substring(at + 1);
    int colon = suffix.indexOf(':');
    long offset;
    long length;
    try {
      offset = Long.parseLong(suffix.substring(0, Math.max(colon, 0)));
      length = Long.parseLong(suffix.substring(colon + 1));
    } catch (NumberFormatException | IndexOutOfBoundsException e) {
      throw new IOException("malformed packed segment location suffix '" + suffix + "'");
    }
    if (offset < 0 || length < 0 || offset + length > object.length) {
      throw new IOException("packed segment [" + offset + ", " + (offset + length)
          + ") lies outside its object of " + object.length + " bytes");
    }
    return Arrays.copyOfRange(object, (int) offset, (int) (offset + length));
  }

  /** The frames of a group, back to back (the object's bytes). */
  static byte[] concat(List<byte[]> frames) {
    int total = 0;
    for (byte[] f : frames) {
      total = Math.addExact(total, f.length);
    }
    byte[] out = new byte[total];
    int at = 0;
    for (byte[] f : frames) {
      System.arraycopy(f, 0, out, at, f.length);
      at += f.length;
    }
    return out;
  }
}
